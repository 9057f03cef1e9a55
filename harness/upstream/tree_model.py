"""The GPT of a Megatron-LM source tree, built with the tree's own classes (the pp and functional workers' `--impl tree`).

The worker runs with the tree first on `PYTHONPATH`, so `megatron` here is the tree's package. `dev`
builds its model the way a user of the tree does: `TransformerConfig(enable_hyper_connections=True,
num_residual_streams=n)`, `get_gpt_layer_local_spec(enable_hyper_connection=True)` ->
`HyperConnectionTransformerLayer`, `GPTModel`; its schedules are n-stream aware themselves (no
`enable_mhc_pipeline`). `main` has the layer and the block hooks but no spec wiring, so the spec is
built here from main's own classes (`MAIN_SPEC_NOTE`), and main's schedules carry C wide tensors
(`MAIN_PP_NOTE`): main runs single-process only.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

__all__ = [
    "MAIN_PP_NOTE",
    "MAIN_SPEC_NOTE",
    "hybrid_chunks",
    "layer_spec",
    "record_tensor_shapes",
    "tree_chunks",
    "tree_config",
]

MAIN_SPEC_NOTE = (
    "main has no mHC spec wiring (megatron/core/models/gpt/gpt_layer_specs.py has no "
    "enable_hyper_connection): the suite builds the layer spec from main's "
    "HyperConnectionTransformerLayer and HyperConnectionModule"
)
MAIN_PP_NOTE = (
    "main's pipeline schedules are not n-stream aware (megatron/core/pipeline_parallel/schedules.py "
    "get_tensor_shapes has no hyper-connection width): main runs single-process only"
)


def tree_config(flavor: str, **kwargs: Any) -> Any:
    """The tree's `TransformerConfig` with mHC on under the flavor's field names (n from `n`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    n = kwargs.pop("n")
    names = (
        {"enable_mhc_connections": True, "mhc_num_residual_streams": n}
        if flavor == "main"
        else {"enable_hyper_connections": True, "num_residual_streams": n}
    )
    return TransformerConfig(**kwargs, **names)


def layer_spec(flavor: str, num_experts: int | None = None) -> Any:
    """The tree's mHC layer spec (local modules, MoE MLPs of `num_experts` local experts when given): dev's
    builder, or main's classes assembled here."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if flavor == "dev":
        return get_gpt_layer_local_spec(num_experts=num_experts, enable_hyper_connection=True)
    from megatron.core.transformer.hyper_connection import HyperConnectionModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import HyperConnectionTransformerLayer

    stock = get_gpt_layer_local_spec(num_experts=num_experts)
    submodules = dataclasses.replace(
        stock.submodules,
        self_attention_hyper_connection=HyperConnectionModule,
        mlp_hyper_connection=HyperConnectionModule,
    )
    return ModuleSpec(module=HyperConnectionTransformerLayer, submodules=submodules)


def _chunks(vpp: int | None, build: Any) -> list[Any]:
    """`build(pre_process=..., post_process=..., vp_stage=...)` for each virtual stage of this rank."""
    from megatron.core import parallel_state as ps

    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        chunks.append(
            build(
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
            )
        )
    return chunks


def tree_chunks(flavor: str, config: Any, *, vpp: int | None, **model_kwargs: Any) -> list[Any]:
    """The model chunks of this rank (one per virtual stage), each a tree `GPTModel`: MoE MLPs where
    `config.num_moe_experts` is set, and with `config.mtp_num_layers` the MTP block of the tree's own
    `get_gpt_mtp_block_spec` on the stage that holds it; `model_kwargs` go to `GPTModel` (`vocab_size`,
    `max_sequence_length`, `share_embeddings_and_output_weights`, `position_embedding_type`). Under
    `config.sequence_parallel` the local spec's norms, which refuse it, are the same torch norms taking it
    (`mhc_core.megatron.norms`; TE's and apex's norms, which take it, are not installed here)."""
    from megatron.core.models.gpt import GPTModel

    from mhc_core.megatron.norms import sequence_parallel_specs

    spec = layer_spec(flavor, num_experts=getattr(config, "num_moe_experts", None))

    def build(vp_stage: int | None, **stage: Any) -> Any:
        mtp: dict[str, Any] = {}
        if getattr(config, "mtp_num_layers", None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp["mtp_block_spec"] = _per_stream_h_proj(
                get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
            )
        # The local spec's torch norms refuse sequence parallelism: the same norms, taking it (a CPU workaround).
        block, mtp_spec = sequence_parallel_specs(config, spec, mtp.get("mtp_block_spec"), vp_stage=vp_stage)
        if mtp_spec is not None:
            mtp["mtp_block_spec"] = mtp_spec
        return GPTModel(config, block, vp_stage=vp_stage, **stage, **mtp, **model_kwargs)

    return _chunks(vpp, build)


@cache
def _per_stream_linear() -> type:
    """The tree's `ColumnParallelLinear` taking `[s, b, n, C]`: with mHC, dev's MTP depth calls its `h_proj` on the
    4-D streams, which TE's linear takes and the local one's backward refuses (`t()` of a 4-D gradient); here the
    leading dims are folded to `[s, b*n, C]` and back, as TE's linear treats them (a CPU workaround, the same
    weights and math; sequence stays first for sequence parallelism)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class PerStreamColumnParallelLinear(ColumnParallelLinear):
        def forward(self, input_: Any, *args: Any, **kwargs: Any) -> Any:
            if input_.dim() <= 3:
                return super().forward(input_, *args, **kwargs)
            lead = input_.shape[:-1]
            out, bias = super().forward(input_.reshape(lead[0], -1, input_.shape[-1]), *args, **kwargs)
            return out.reshape(*lead, out.shape[-1]), bias

    return PerStreamColumnParallelLinear


def _per_stream_h_proj(block_spec: Any) -> Any:
    """`block_spec` (an MTP block's `ModuleSpec`, or its submodules as `get_gpt_mtp_block_spec` returns them) with
    each depth's `h_proj`, where it has one, the per-stream linear."""
    if block_spec is None:
        return None
    subs = getattr(block_spec, "submodules", block_spec)
    layers = [
        dataclasses.replace(
            layer, submodules=dataclasses.replace(layer.submodules, h_proj=_per_stream_linear())
        )
        if getattr(layer.submodules, "h_proj", None) is not None
        else layer
        for layer in subs.layer_specs
    ]
    subs = dataclasses.replace(subs, layer_specs=layers)
    return (
        dataclasses.replace(block_spec, submodules=subs)
        if subs is not block_spec and hasattr(block_spec, "submodules")
        else subs
    )


def _hybrid_mtp_block_spec() -> Any:
    """A local MTP block spec from the tree's own classes (the tree's is TE-only): its torch norms, column-parallel
    `eh_proj` / `e_proj`, the per-stream `h_proj` (`_per_stream_linear`); the depths' inner layers the tree builds
    from the pattern itself."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=WrappedTorchNorm,
            hnorm=WrappedTorchNorm,
            eh_proj=ColumnParallelLinear,
            e_proj=ColumnParallelLinear,
            h_proj=_per_stream_linear(),
            mtp_model_layer=None,
            layer_norm=WrappedTorchNorm,
        ),
    )
    return ModuleSpec(
        module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer])
    )


def _hybrid_stack_spec(num_experts: int | None, mtp: bool = False) -> Any:
    """A local `HybridStack` spec from the tree's own classes (the tree's hybrid specs are TE-only): attention
    (`TransformerLayer`: norm + self-attention), MLP (`MLPLayer`: norm + MLP), MoE (`MoETransformerLayer`:
    norm + `MoELayer` of `num_experts` local experts), each from the tree's `get_gpt_layer_local_spec`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense = get_gpt_layer_local_spec().submodules
    parts: dict[str, Any] = dict(
        attention_layer=ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=dense.input_layernorm,
                self_attention=dense.self_attention,
                self_attn_bda=dense.self_attn_bda,
            ),
        ),
        mlp_layer=ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda
            ),
        ),
    )
    if num_experts:
        moe = get_gpt_layer_local_spec(num_experts=num_experts).submodules
        parts["moe_layer"] = ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda
            ),
        )
    if mtp:
        parts["mtp_block_spec"] = _hybrid_mtp_block_spec()
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**parts))


def hybrid_chunks(config: Any, pattern: str, *, vpp: int | None, **model_kwargs: Any) -> list[Any]:
    """This rank's chunks of the tree's own `HybridModel` with mHC for `pattern` (dev only), a local spec from the
    tree's classes; its final norm, which the tree builds as `TENorm`, is the tree's torch norm where TE is
    absent (a CPU workaround: the module is the same norm TE's would compute). `model_kwargs` go to `HybridModel`
    (`vocab_size`, `max_sequence_length`, `position_embedding_type`, `share_embeddings_and_output_weights`)."""
    import importlib.util

    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = _hybrid_stack_spec(getattr(config, "num_moe_experts", None), mtp="/" in pattern)
    te_norm = hybrid_block.TENorm
    if importlib.util.find_spec("transformer_engine") is None:
        hybrid_block.TENorm = WrappedTorchNorm
    try:
        return _chunks(
            vpp,
            lambda **stage: HybridModel(config, spec, hybrid_layer_pattern=pattern, **stage, **model_kwargs),
        )
    finally:
        hybrid_block.TENorm = te_norm


def record_tensor_shapes(schedules: Any, calls: list[dict]) -> None:
    """Wrap the tree's `schedules.get_tensor_shapes` so that every call appends what it was asked and
    what it returned to `calls` (`{"is_recv", "pp_rank", "pp_size", "seq_length", "micro_batch_size",
    "sequence_parallel", "tp_size", "cp_size", "shapes"}`)."""
    stock = schedules.get_tensor_shapes

    def get_tensor_shapes(*args: Any, **kwargs: Any) -> Any:
        shapes = stock(*args, **kwargs)
        pp, tp, cp = kwargs.get("pp_group"), kwargs.get("tp_group"), kwargs.get("cp_group")
        calls.append(
            {
                "is_recv": kwargs.get("is_recv", True),
                "pp_rank": pp.rank() if pp else None,
                "pp_size": pp.size() if pp else None,
                "seq_length": kwargs.get("seq_length"),
                "micro_batch_size": kwargs.get("micro_batch_size"),
                "sequence_parallel": bool(kwargs["config"].sequence_parallel),
                "tp_size": tp.size() if tp else 1,
                "cp_size": cp.size() if cp else 1,
                "shapes": [tuple(s) for s in shapes],
            }
        )
        return shapes

    schedules.get_tensor_shapes = get_tensor_shapes
