"""megatron-core's `DistributedOptimizer` with parameters kept fp32 in a half-precision model.

Under bf16 mixed precision `megatron_dev` keeps the mHC parameters fp32 (`mhc_core.precision`), so an
optimizer parameter group (all no-weight-decay parameters, say) holds fp32 and bf16 model parameters
side by side. `DistributedOptimizer` (megatron-core 0.16.1 and 0.19.2) records each model parameter's
place in its group as `model_param_group_index_map[p] = (group, order)` in the order of the gradient
buffers, but hands the inner optimizer the group reordered: the group's fp32 shards first, then the
fp32 main copies of its half shards. Stepping is right (it walks the two lists side by side); what
reads the map is wrong: `_get_main_param_and_optimizer_states` returns another parameter's main
copy and Adam state, so the `dp_reshardable` checkpoint of a mixed group fails its shape assertion
(`(torch.Size([24]), 0, 64)`: the `[N]` bias of an mHC module at the place of a `[C]` norm weight),
or, where two shapes agree, writes one parameter's state under another's key.

`align_param_group_index_map` rewrites the map in the inner optimizer's order. It is idempotent and
moves nothing when no group mixes dtypes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["align_param_group_index_map", "optimizer_parts"]


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The optimizers inside megatron-core's `ChainedOptimizer` (what `get_megatron_optimizer` returns), or
    `[optimizer]`."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def align_param_group_index_map(optimizer: Any) -> int:
    """Point every model parameter of each `DistributedOptimizer` part of `optimizer` at its place in the inner
    optimizer's groups (`[fp32 params..., half params...]` per group); returns how many entries moved."""
    moved = 0
    for part in optimizer_parts(optimizer):
        index_map = getattr(part, "model_param_group_index_map", None)
        if index_map is None:  # not a DistributedOptimizer
            continue
        groups = zip(part.model_fp32_groups, part.model_float16_groups, strict=True)
        for group, (fp32_params, half_params) in enumerate(groups):
            for order, param in enumerate([*fp32_params, *half_params]):
                if index_map.get(param) != (group, order):
                    index_map[param] = (group, order)
                    moved += 1
    return moved
