"""Multi-token prediction (MTP) with mHC: upstream dev's semantics on megatron-core's MTP block.

Legend: s sequence, b micro-batch, C hidden size, n residual streams, D MTP depths.

The decoder hands MTP two tensors: the contracted `[s, b, C]` (for the lm head) and the
pre-contraction streams `[s, b, n*C]` (`HyperConnectionTransformerBlock.mtp_streams`). Depth k:

    e = e_proj(enorm(embedding(tokens shifted by k)))             # [s, b, C]
    x = e[:, :, None, :] + h_proj(hnorm(streams_k))               # per stream, [s, b, n, C]
    streams_{k+1} = inner mHC layer(x.view(s, b, n*C))            # n streams in and out, no expand
    out_k = final_layernorm(contract(streams_{k+1}))              # [s, b, C], to the shared lm head

`hnorm` normalises each stream on C, `h_proj` and `e_proj` are C -> C column-parallel linears (the
stock layer's one 2C -> C `eh_proj` is not built with mHC), and the contraction is the decoder's rule
(`mhc_core.ops.contract` or, with `mhc_learned_contraction`, `learned_contract` with this depth's own
`hc_head_fn [n, n*C]`, `hc_head_base [n]`, `hc_head_scale [1]`). State-dict keys are dev's
(`mtp.layers.<k>.e_proj.weight`, `.h_proj.weight`, `.hc_head_fn`, ...); the inner layer keeps the
installed megatron-core's name (`transformer_layer` in 0.16, `mtp_model_layer` from 0.17, as dev).

The block returns `[(1 + D) * s, b, C]` as megatron-core's does: the decoder's contracted output,
then each depth's `out_k`, which `GPTModel._postprocess` turns into the lm and `mtp_<k> loss`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import multi_token_prediction as mcore_mtp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import make_viewless_tensor
from torch import Tensor, nn

from mhc_core.megatron.block import StreamContraction
from mhc_core.precision import KeepInFp32Mixin

__all__ = [
    "HyperConnectionMTPBlock",
    "HyperConnectionMTPLayer",
    "get_gpt_mtp_block_spec",
    "tracked_mtp_losses",
]

_INNER_NAMES = ("mtp_model_layer", "transformer_layer")


def _inner_field(submodules: Any) -> str:
    """The field of the MTP layer submodules that holds the inner transformer layer, by version."""
    names = {f.name for f in dataclasses.fields(submodules)}
    for name in _INNER_NAMES:
        if name in names:
            return name
    raise RuntimeError(
        f"{type(submodules).__name__} has none of the fields {_INNER_NAMES}: "
        "mhc_core.megatron.mtp needs updating for this megatron-core"
    )


class HyperConnectionMTPLayer(StreamContraction, KeepInFp32Mixin, mcore_mtp.MultiTokenPredictionLayer):
    """One MTP depth on n streams: `[s, b, n*C]` in, `[s, b, n*C]` out of `forward`.

    Same constructor as the installed `MultiTokenPredictionLayer`; its `eh_proj` spec is the
    column-parallel linear that builds `e_proj` and `h_proj`. With `config.enable_mhc_connections`
    off it is the stock layer.
    """

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any):
        super().__init__(config, submodules, *args, **kwargs)
        self.mhc_enabled = bool(getattr(config, "enable_mhc_connections", False))
        self._streams_out = False
        if not self.mhc_enabled:
            return
        self.num_residual_streams = int(config.mhc_num_residual_streams)
        self.learned_contraction = bool(getattr(config, "mhc_learned_contraction", False))
        linear = submodules.eh_proj
        del self.eh_proj  # the stock 2C -> C projection: mHC has e_proj and h_proj instead
        self.eh_proj: nn.Module | None = None
        self.e_proj = self._build_projection(linear, config, "mtp_e_proj")
        self.h_proj = self._build_projection(linear, config, "mtp_h_proj")
        if self.learned_contraction:
            self._build_learned_contraction(config)

    def _build_projection(self, linear: Any, config: Any, buffer_name: str) -> nn.Module:
        """A C -> C column-parallel linear, built with the arguments the stock `eh_proj` gets."""
        extra: dict[str, Any] = {}
        params = inspect.signature(linear).parameters if isinstance(linear, type) else {}
        if "tp_group" in params:
            extra["tp_group"] = self._tp_group()
        if "tp_comm_buffer_name" in params:
            extra["tp_comm_buffer_name"] = buffer_name
        c = config.hidden_size
        return build_module(
            linear,
            c,
            c,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            **extra,
        )

    def _check_streams(self, hidden_states: Tensor) -> None:
        n, c = self.num_residual_streams, self.config.hidden_size
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != n * c:
            raise ValueError(
                f"HyperConnectionMTPLayer (depth {self.layer_number}, n = {n}, C = {c}): its input must "
                f"be the streams [s, b, n*C], last dim {n * c}; got {list(hidden_states.shape)}"
            )

    def _concat_embeddings(self, hidden_states: Tensor, decoder_input: Tensor) -> Tensor:
        """`[s, b, n*C]` streams and `[s, b, C]` embedding -> `[s, b, n*C]`, the inner layer's input."""
        if not self.mhc_enabled:
            return super()._concat_embeddings(hidden_states, decoder_input)
        self._check_streams(hidden_states)
        n, c = self.num_residual_streams, self.config.hidden_size
        s, b, _ = hidden_states.shape
        decoder_input = self.enorm(decoder_input)
        decoder_input = make_viewless_tensor(inp=decoder_input, requires_grad=True, keep_graph=True)
        streams = self.hnorm(hidden_states.view(s, b, n, c))  # per stream, over C
        streams = make_viewless_tensor(inp=streams, requires_grad=True, keep_graph=True)
        e_out, _ = self.e_proj(decoder_input)  # [s, b, C/tp]
        h_out, _ = self.h_proj(streams.reshape(s, b * n, c))  # [s, b*n, C/tp]
        mixed = e_out.unsqueeze(2) + h_out.view(s, b, n, -1)  # [s, b, n, C/tp]
        group = self._tp_group()
        mixed = gather_from_tensor_model_parallel_region(mixed, group=group)
        mixed = mixed.reshape(s, b, n * c)
        if self.sequence_parallel:
            mixed = scatter_to_sequence_parallel_region(mixed, group=group)
        return mixed

    def _tp_group(self) -> Any:
        """The layer's tensor-parallel group (megatron-core >= 0.17 keeps one; 0.16 uses the global one)."""
        group = getattr(self, "tp_group", None)
        return group if group is not None else parallel_state.get_tensor_model_parallel_group()

    def _proj_and_transformer_layer(self, *args: Any, **kwargs: Any) -> Tensor:
        """The stock step with the streams left uncontracted (`contract_and_norm` is the block's call)."""
        if not self.mhc_enabled:
            return super()._proj_and_transformer_layer(*args, **kwargs)
        self._streams_out = True
        try:
            return super()._proj_and_transformer_layer(*args, **kwargs)
        finally:
            self._streams_out = False

    def _postprocess(self, hidden_states: Tensor) -> Tensor:
        if self.mhc_enabled and self._streams_out:
            return hidden_states  # the n streams go on to the next depth
        return super()._postprocess(hidden_states)

    def contract_streams(self, hidden_states: Tensor) -> Tensor:
        """`[s, b, n*C] -> [s, b, C]`: the mean of the streams, or this depth's learned contraction."""
        self._check_streams(hidden_states)
        return super().contract_streams(hidden_states)

    def contract_and_norm(self, hidden_states: Tensor) -> Tensor:
        """`[s, b, n*C] -> [s, b, C]`: this depth's output for the shared lm head."""
        return super()._postprocess(self.contract_streams(hidden_states))


class HyperConnectionMTPBlock(mcore_mtp.MultiTokenPredictionBlock):
    """`MultiTokenPredictionBlock` whose depths run on the decoder's n streams.

    Same constructor as the installed block. With mHC its `forward` takes the decoder's
    pre-contraction streams from `streams_from_decoder` (the model's `_postprocess` opens it) and
    returns `[(1 + D) * s, b, C]`: the decoder's contracted output, then each depth's.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.mhc_enabled = bool(getattr(config, "enable_mhc_connections", False))
        self._streams: Tensor | None = None
        if self.mhc_enabled:
            for i, layer in enumerate(self.layers):
                if not isinstance(layer, HyperConnectionMTPLayer):
                    raise ValueError(
                        f"HyperConnectionMTPBlock: layers[{i}] is a {type(layer).__name__}, but mHC needs "
                        "HyperConnectionMTPLayer (build the spec with mhc_core.megatron.get_gpt_mtp_block_spec)"
                    )

    @contextmanager
    def streams_from_decoder(self, streams: Tensor | None) -> Iterator[None]:
        """Within the block, `forward` runs its depths from `streams` `[s, b, n*C]`."""
        self._streams = streams
        try:
            yield
        finally:
            self._streams = None

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self.mhc_enabled:
            return super().forward(*args, **kwargs)
        if args:
            raise TypeError(
                "HyperConnectionMTPBlock.forward takes keyword arguments only (as GPTModel calls it)"
            )
        offset = mcore_mtp.get_mtp_layer_offset(self.config, self.vp_stage)
        if offset != 0:
            raise NotImplementedError(
                f"HyperConnectionMTPBlock: MTP depths split over stages (offset {offset}) are not "
                "supported with mHC: the decoder's streams reach only the stage with its final layernorm"
            )
        streams = self._streams
        if streams is None:
            raise RuntimeError(
                "HyperConnectionMTPBlock: no decoder streams [s, b, n*C]; MTP with mHC runs inside "
                "MHCGPTModel, whose decoder hands them over (HyperConnectionTransformerBlock.mtp_streams)"
            )
        hidden_states = kwargs.pop("hidden_states")
        if getattr(self.config, "mtp_detach_heads", False):
            streams = streams.detach()
        extra = kwargs.pop("extra_block_kwargs", None) or {}
        outputs = [hidden_states]
        repeated = bool(getattr(self, "mtp_use_repeated_layer", False))
        for depth in range(self.config.mtp_num_layers):
            layer = self.layers[0 if repeated else depth]
            result = layer(hidden_states=streams, **kwargs, **extra)
            streams, kwargs["input_ids"], kwargs["position_ids"] = result[0], result[1], result[2]
            if len(result) > 3:  # megatron-core >= 0.17 rolls the padding mask too
                kwargs["padding_mask"] = result[3]
            outputs.append(layer.contract_and_norm(streams))
        return torch.cat(outputs, dim=0)


def get_gpt_mtp_block_spec(
    config: Any,
    layer_spec: ModuleSpec,
    *,
    use_transformer_engine: bool = False,
    vp_stage: int | None = None,
    inner: ModuleSpec | None = None,
) -> Any:
    """The MTP block spec of the installed megatron-core for this stage, each depth an mHC depth.

    Args:
        layer_spec: the decoder's layer spec (an mHC spec when `config.enable_mhc_connections`);
            each depth's inner layer is built from it, as upstream builds it from the decoder's last layer.
        inner: each depth's inner layer instead (the hybrid stack's `HybridLayerSequence`); `layer_spec` then
            only shapes megatron-core's depth (its norms and projection).

    Returns:
        `MultiTokenPredictionBlockSubmodules`, or None where this stage builds no MTP depth.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    stock = ModuleSpec(module=TransformerLayer, submodules=layer_spec.submodules, params=layer_spec.params)
    spec = gpt_layer_specs.get_gpt_mtp_block_spec(
        config, stock, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage
    )
    if spec is None or not getattr(config, "enable_mhc_connections", False):
        return spec
    depths = []
    for depth in spec.layer_specs:
        field = _inner_field(depth.submodules)
        submodules = dataclasses.replace(depth.submodules, **{field: inner or layer_spec})
        depths.append(dataclasses.replace(depth, module=HyperConnectionMTPLayer, submodules=submodules))
    return dataclasses.replace(spec, layer_specs=depths)


def tracked_mtp_losses() -> Tensor | None:
    """`[D]`: the per-depth MTP losses megatron-core's tracker has summed since it was last cleared (each a
    micro-batch's token mean), None before the first; the key is `values` in 0.16, `loss_values` from 0.17 and
    `loss_sums` in upstream dev (whose per-token mode, `calculate_per_token_loss`, sums losses and token counts
    apart: ValueError naming it)."""
    tracker = mcore_mtp.MTPLossLoggingHelper.tracker
    if tracker.get("calculate_per_token_loss"):
        raise ValueError(
            "megatron-core's MTP tracker holds per-token loss sums (calculate_per_token_loss=True); the "
            "per-depth MTP loss here is the micro-batch mean: train without calculate_per_token_loss"
        )
    values = tracker.get("loss_values", tracker.get("values", tracker.get("loss_sums")))
    return values if isinstance(values, Tensor) else None
