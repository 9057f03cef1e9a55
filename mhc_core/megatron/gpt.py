"""`MHCGPTModel` (a `GPTModel` whose decoder is the mHC block) and `build_gpt_model` (the role of
upstream `gpt_builders.py`: thread `config.enable_mhc_connections` into the layer spec)."""

from __future__ import annotations

from typing import Any, Literal

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec, get_module

from mhc_core.checks import check_int
from mhc_core.megatron.block import HyperConnectionTransformerBlock
from mhc_core.megatron.compat import gpt_model_classes
from mhc_core.megatron.layer import HyperConnectionTransformerLayer
from mhc_core.megatron.mtp import HyperConnectionMTPBlock, get_gpt_mtp_block_spec
from mhc_core.megatron.norms import sequence_parallel_specs
from mhc_core.megatron.specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec

__all__ = ["MHCGPTModel", "build_gpt_model"]


class MHCGPTModel(GPTModel):
    """`GPTModel` whose `decoder` is a `HyperConnectionTransformerBlock` (and `mtp` a `HyperConnectionMTPBlock`).

    Same constructor as the installed `GPTModel` (all arguments passed through); the decoder and the
    MTP block are built once, by `GPTModel.__init__` itself, as the mHC classes (see
    `compat.gpt_model_classes`). With `config.enable_mhc_connections` off the blocks are the stock
    blocks, so the model equals a `GPTModel`. With MTP, the decoder's pre-contraction streams reach
    the MTP block within `_postprocess` (upstream dev's `mhc_multistream`).
    """

    def __init__(self, config: Any, transformer_layer_spec: ModuleSpec, *args: Any, **kwargs: Any):
        with gpt_model_classes(
            TransformerBlock=HyperConnectionTransformerBlock,
            MultiTokenPredictionBlock=HyperConnectionMTPBlock,
        ):
            super().__init__(config, transformer_layer_spec, *args, **kwargs)
        if not isinstance(self.decoder, HyperConnectionTransformerBlock):
            raise RuntimeError(
                f"MHCGPTModel: GPTModel built its decoder as {type(self.decoder).__name__}, not "
                "HyperConnectionTransformerBlock; mhc_core.megatron.compat needs updating"
            )

    def _postprocess(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if not (self.mtp_process and self.decoder.mhc_enabled):
            return super()._postprocess(hidden_states, *args, **kwargs)
        streams, self.decoder.mtp_streams = self.decoder.mtp_streams, None
        with self.mtp.streams_from_decoder(streams):
            return super()._postprocess(hidden_states, *args, **kwargs)


def _layer_class(spec: Any) -> Any:
    return get_module(spec) if isinstance(spec, ModuleSpec) else spec


def build_gpt_model(
    config: Any,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    spec: Literal["local", "te"] | ModuleSpec = "local",
    **kwargs: Any,
) -> GPTModel:
    """A GPT model for `config`: `MHCGPTModel` when `config.enable_mhc_connections`, else `GPTModel`.

    Args:
        config: a `TransformerConfig` (an `MHCTransformerConfig` for mHC).
        spec: `"local"` (megatron-core modules; under `config.sequence_parallel` with torch norms that take it,
            `mhc_core.megatron.norms`), `"te"` (Transformer Engine), or a layer `ModuleSpec`, which must match
            the flag (an mHC layer spec exactly when mHC is on).
        **kwargs: passed to the model constructor (`position_embedding_type`,
            `share_embeddings_and_output_weights`, `parallel_output`, ...). With `config.mtp_num_layers`
            and no `mtp_block_spec`, this stage's MTP block spec is built from the layer spec
            (`mhc_core.megatron.mtp.get_gpt_mtp_block_spec`).

    Raises:
        ValueError: an unknown `spec` name, a layer spec that does not match the flag, or a
            `vocab_size` / `max_sequence_length` that is not an integer >= 1, a `vp_stage` outside the
            config's virtual pipeline stages.
        ImportError: `spec="te"` without transformer_engine.
    """
    check_int(vocab_size, name="vocab_size", op="build_gpt_model")
    check_int(max_sequence_length, name="max_sequence_length", op="build_gpt_model")
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp_stage is not None and (
        isinstance(vp_stage, bool) or not isinstance(vp_stage, int) or not 0 <= vp_stage < (vpp or 1)
    ):
        raise ValueError(
            f"build_gpt_model: vp_stage={vp_stage!r} must be None or an integer in [0, "
            f"virtual_pipeline_model_parallel_size={vpp or 1})"
        )
    enable = bool(getattr(config, "enable_mhc_connections", False))
    common = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        enable_mhc=enable,
    )
    if isinstance(spec, ModuleSpec):
        is_mhc = isinstance(_layer_class(spec), type) and issubclass(
            _layer_class(spec), HyperConnectionTransformerLayer
        )
        if is_mhc != enable:
            raise ValueError(
                f"build_gpt_model: spec module {_layer_class(spec)!r} does not match "
                f"config.enable_mhc_connections={enable} (an mHC layer spec exactly when mHC is on)"
            )
        layer_spec = spec
    elif spec == "local":
        layer_spec = get_gpt_layer_local_spec(normalization=config.normalization, **common)
    elif spec == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(**common)
    else:
        raise ValueError(f"build_gpt_model: spec={spec!r}; valid: 'local', 'te' or a ModuleSpec")
    model_cls = MHCGPTModel if enable else GPTModel
    if getattr(config, "mtp_num_layers", None) and "mtp_block_spec" not in kwargs:
        kwargs["mtp_block_spec"] = get_gpt_mtp_block_spec(
            config, layer_spec, use_transformer_engine=spec == "te", vp_stage=vp_stage
        )
    block_spec: Any = layer_spec
    if spec == "local":  # megatron-core's local norms refuse sequence parallelism: torch norms that take it
        block_spec, mtp = sequence_parallel_specs(
            config, layer_spec, kwargs.get("mtp_block_spec"), vp_stage=vp_stage
        )
        if mtp is not None:
            kwargs["mtp_block_spec"] = mtp
    return model_cls(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **kwargs,
    )
