"""Upstream Megatron-LM's single-pass mHC (DeepSeek-V4.1): `single_pass_mhc.py` over a tree's `HyperConnectionModule`.

Upstream's first single-pass code, `megatron/core/transformer/single_pass_mhc.py` (Megatron-LM 9633c754), is newer
than any tree at hand and is one file: `SinglePassHyperConnection`, a subclass of the tree's `HyperConnectionModule`
(`compute_mappings` with V4.1's RMS factor `rsqrt(mean(x^2) + eps)`, `forward(hidden, previous_mix) -> (branch,
next_mix, post, residual)`, `combine`) and `contract_streams` (the entry's stream 0, the exit with the last mix).
What it needs of its base is the dev generation's API (`n`, `hidden_size`, `sinkhorn_iterations`, the mapping
parameters, `config.use_fused_mhc` and the `_sinkhorn_op` / `_h_aggregate_op` / `_h_post_bda_op` it selects), which
dev d48bd6be's module has: the file runs unchanged on that tree, its own logic, nothing stood in. Its parameters
are replaced by the check's tensors (`bind_params`), so gradients reach them. Layout: `[T, n, C]` ->
`[s = T, b = 1, n*C]`.

Ops: `single_pass` (`forward`), `aggregate` (`contract_streams`: the exit, and the native branch input), `mix`
(`combine`). Like the tree peers, it runs in a process that imported the tree's `megatron`
(`harness.conformance.record_single_pass` records it; `harness.conformance.replay` replays the recording in CI).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.peers.base import Peer, SublayerParams
from harness.peers.megatron_lm import bind_params, load_tree
from harness.upstream.source_tree import load_file

__all__ = ["FILE", "MODULE", "NORM_EPS", "MegatronSinglePassPeer"]

FILE = "megatron/core/transformer/single_pass_mhc.py"
"""Where the file sits in upstream's tree."""
MODULE = "megatron.core.transformer.single_pass_mhc"
NORM_EPS = 1e-6
"""The config's `layernorm_epsilon`, which the module takes as its RMS eps (the checks' eps; DeepSeek's
`rms_norm_eps`)."""


@dataclass(frozen=True, kw_only=True)
class MegatronSinglePassPeer(Peer):
    """Upstream's `SinglePassHyperConnection` from `file` over `tree`'s module (see the module docstring)."""

    tree: Path
    file: Path
    """The `single_pass_mhc.py` to run."""
    fused: bool = False
    """`use_fused_mhc`: the tree's fused Sinkhorn, aggregate and post (its torch backend on CPU)."""
    ops: frozenset[str] = frozenset({"single_pass", "aggregate", "mix"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    """fp32 (it upcasts to fp32, so fp64 would be rounded) and bf16, the dtype it trains in."""
    claims: str | None = "megatron_dev+eps_inside_sqrt"
    """DeepSeek-V4.1's numerics as the checks tell them (the fp32 coefficients do not show)."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "single-pass: its coefficients come with the aggregate of the previous mix (the "
            "single-pass checks); V4's per-sublayer pre is the tree's own module (the megatron_lm[dev] rows)",
            "stack": "its composition is the model's (DSv41HybridStack, hybrid_stack.py 02ab972c: the mix packed "
            "behind the streams across stages), not runnable outside a Megatron model: the handoff is checked per "
            "sublayer here, and across stages by the pp suite's single-pass cases for ours",
        }
    )
    commit: str | None = None

    def version(self) -> str | None:
        return self.commit

    def _loaded(self) -> Any:
        load_tree(self.tree)
        import sys

        return sys.modules.get(MODULE) or load_file(MODULE, self.file)

    def _module(self, n: int, c: int, iterations: int, params: SublayerParams | None) -> Any:
        sp = self._loaded()
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=1,
            hidden_size=c,
            num_attention_heads=1,
            use_cpu_initialization=True,
            mhc_sinkhorn_iterations=iterations,
            recompute_granularity="selective",
            recompute_modules=["mhc"],
            enable_hyper_connections=True,
            num_residual_streams=n,
            use_fused_mhc=self.fused,
            layernorm_epsilon=NORM_EPS,
        )
        mod = sp.SinglePassHyperConnection(config, layer_number=1)
        if params is not None:
            del mod.mapping_proj.weight, mod.alpha_pre, mod.alpha_post, mod.alpha_res, mod.bias
            bind_params(mod, params)
        return mod

    def single_pass(self, x, previous_h_pre, params: SublayerParams, iterations):
        t, n, c = x.shape
        mod = self._module(n, c, iterations, params)
        prev = None if previous_h_pre is None else previous_h_pre.reshape(t, 1, n)
        branch, next_mix, post, residual = mod(x.reshape(t, 1, n * c), prev)
        return {
            "aggregate": branch.reshape(t, c),
            "next_h_pre": next_mix.reshape(t, n),
            "h_post": post.reshape(t, n),
            "h_res": residual.reshape(t, n, n),
        }

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        return (
            self._loaded().contract_streams(x.reshape(t, 1, n * c), h_pre.reshape(t, 1, n), n).reshape(t, c)
        )

    def mix(self, h_res, residual, h_post, y):
        """`combine` given the coefficients in fp32, as its `compute_mappings` always returns them (its fused path
        refuses bf16 ones beside its fp32 streams: `expected scalar type BFloat16 but found Float`)."""
        t, n, c = residual.shape
        mod = self._module(n, c, 1, None)
        out = mod.combine(
            y.reshape(t, 1, c),
            residual.reshape(t, 1, n * c),
            h_post.float().reshape(t, 1, n),
            h_res.float().reshape(t, 1, n, n),
        )
        return out.reshape(t, n, c)
