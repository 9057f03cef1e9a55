"""A hybrid stack with mHC: one hyper connection around each layer of a layer pattern (upstream dev's
`HyperConnectionHybridLayer`), on megatron-core's `TransformerBlock`.

Legend: s sequence, b micro-batch, C hidden size, n residual streams.

A pattern names one layer per symbol, as upstream's `hybrid_layer_allocation`: `*` attention, `-` MLP, `E` MoE;
`|` is a pipeline stage boundary; `/` starts the multi-token prediction depths, dev's unified form
`<main>/<mtp>/<mtp>...` (one segment per depth, all alike): each depth is a `HyperConnectionMTPLayer`
(`mhc_core.megatron.mtp`: `e_proj` / `h_proj`, its own contraction) whose inner layers are the depth's pattern
as hybrid layers, run nested on the n streams without an expand of their own (`HybridLayerSequence`), on the
last stage. Each layer is a `HyperConnectionHybridLayer` holding one
`HyperConnectionModule` (`hyper_connection`) and the wrapped megatron-core `TransformerLayer` (`inner_layer`,
with the other branch an `IdentityOp`): dev's keys, `decoder.layers.<i>.hyper_connection.*` and
`decoder.layers.<i>.inner_layer.*`. Per layer, `x [s, b, n*C]`:

    aggregated, h_res, h_post, residual = hyper_connection(x)
    y, bias = branch(norm(aggregated))          # single-branch layers: the raw branch output
    x = hyper_connection.post_residual_bda(h_res, residual, h_post, (y, bias), hidden_dropout, training)

With `mhc_single_pass` (DeepSeek-V4.1's hybrid stack) `x` is the carrier `[s, b, n*C + k]` and each layer
aggregates with the `H_pre` the previous layer left in it (`mhc_core.megatron.layer`, `mhc_core.handoff`).

A layer holding both branches runs whole and feeds `layer_output - aggregated` (its own residual already
added), with no further dropout, as dev does. The block boundary (expand, contract, the final norm, n*C wide
pipeline hops) is the GPT one: `HyperConnectionTransformerBlock`. Symbols that need CUDA-only packages or
Transformer Engine (`M` Mamba, `G` gated delta net, `D` DSA, `C` / `H` / `W` DeepSeek-V4 attention) are refused
with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import Tensor

from mhc_core.megatron.layer import RecomputeMember
from mhc_core.module import HyperConnectionModule

__all__ = [
    "HyperConnectionHybridLayer",
    "HybridLayerSequence",
    "HybridLayerSubmodules",
    "HybridSequenceSubmodules",
    "gpt_key",
    "hybrid_block_spec",
    "hybrid_key",
    "hybrid_layout",
    "hybrid_mtp_block_spec",
    "parse_pattern",
    "split_mtp",
]

ATTENTION, MLP, MOE, STAGE, MTP = "*", "-", "E", "|", "/"
RUNS_HERE = (ATTENTION, MLP, MOE)
NOT_HERE = {
    "M": "Mamba needs mamba_ssm's CUDA kernels",
    "G": "the gated delta net needs its CUDA-only kernels",
    "D": "DSA (DeepSeek sparse attention) needs Transformer Engine and CUDA kernels",
    "C": "DeepSeek-V4's compressed attention needs Transformer Engine",
    "H": "DeepSeek-V4's hybrid attention needs Transformer Engine",
    "W": "DeepSeek-V4's windowed attention needs Transformer Engine",
}
"""Symbols of upstream's patterns this stack refuses, and why."""


def split_mtp(pattern: str) -> tuple[str, str | None, int]:
    """dev's unified pattern `<main>/<mtp>/<mtp>...` -> `(main, the depths' pattern or None, the depth count)`.

    Raises:
        ValueError: an empty depth, depths that differ, or a stage boundary inside a depth, naming the pattern.
    """
    main, *depths = pattern.split(MTP)
    if not depths:
        return pattern, None, 0
    if any(not d for d in depths):
        raise ValueError(f"hybrid pattern {pattern!r}: an MTP depth after {MTP!r} holds no layer")
    if len(set(depths)) != 1:
        raise ValueError(
            f"hybrid pattern {pattern!r}: every MTP depth has the same layers (dev's form "
            f"<main>/<mtp>/<mtp>), got {depths}"
        )
    if STAGE in depths[0]:
        raise ValueError(
            f"hybrid pattern {pattern!r}: an MTP depth holds no stage boundary {STAGE!r} (the depths run "
            "on the last stage)"
        )
    return main, depths[0], len(depths)


def parse_pattern(pattern: str) -> list[str]:
    """`pattern` -> one segment of layer symbols per pipeline stage (split at `|`; MTP depths after `/` aside:
    `split_mtp`).

    Raises:
        ValueError: an unknown symbol or an empty segment, naming the pattern and the position.
        NotImplementedError: a symbol that cannot run here (`NOT_HERE`), with its reason.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"hybrid pattern {pattern!r}: a non-empty string of {RUNS_HERE}, {STAGE!r} and {MTP!r}"
        )
    for i, sym in enumerate(pattern):
        if sym in NOT_HERE:
            raise NotImplementedError(f"hybrid pattern {pattern!r}: {sym!r} at position {i}: {NOT_HERE[sym]}")
        if sym not in RUNS_HERE and sym not in (STAGE, MTP):
            raise ValueError(
                f"hybrid pattern {pattern!r}: unknown symbol {sym!r} at position {i}; valid: "
                f"{', '.join(RUNS_HERE)}, {STAGE!r} (a stage boundary) and {MTP!r} (MTP depths)"
            )
    main, _, _ = split_mtp(pattern)
    segments = main.split(STAGE)
    empty = [i for i, seg in enumerate(segments) if not seg]
    if empty:
        raise ValueError(f"hybrid pattern {pattern!r}: stage {empty[0]} holds no layer")
    return segments


def hybrid_layout(pattern: str) -> str:
    """megatron-core's `pipeline_model_parallel_layout` for the pattern's stages: `*-|*E` -> `Ett|ttL`; MTP depths
    on the last stage: `*-|*E/*E` -> `Ett|ttmL`."""
    segments = parse_pattern(pattern)
    depths = split_mtp(pattern)[2]
    stages = ["t" * len(seg) for seg in segments]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * depths + "L"
    return "|".join(stages)


@dataclasses.dataclass
class HybridLayerSubmodules:
    """The wrapped layer's spec (a `TransformerLayer` spec, one branch possibly an `IdentityOp`)."""

    inner_layer: ModuleSpec | type = IdentityOp


class HyperConnectionHybridLayer(RecomputeMember, MegatronModule):
    """One hyper connection around one hybrid layer: `[s, b, n*C]` in and out.

    Built by `TransformerBlock` like a layer (`config`, `submodules`, `layer_number`, ...); `forward` takes the
    layer's keyword arguments and returns `(hidden_states, context)`.
    """

    def __init__(self, config: Any, submodules: HybridLayerSubmodules, layer_number: int = 1, **kwargs: Any):
        super().__init__(config=config)
        self.inner_layer = build_module(
            submodules.inner_layer, config=config, layer_number=layer_number, **kwargs
        )
        if not isinstance(self.inner_layer, TransformerLayer):
            raise TypeError(
                f"HyperConnectionHybridLayer: the wrapped layer is a {type(self.inner_layer).__name__}; "
                "only megatron-core TransformerLayer branches run here"
            )
        self.layer_number = self.inner_layer.layer_number
        self.hyper_connection = HyperConnectionModule(config, layer_number=self.layer_number)
        layer = self.inner_layer
        self.has_attention = not isinstance(layer.self_attention, IdentityOp)
        self.has_mlp = not isinstance(layer.mlp, IdentityOp)

    @property
    def single_branch(self) -> bool:
        """Exactly one of attention and MLP: its raw output feeds the n-stream update (dev's fast path)."""
        return self.has_attention != self.has_mlp

    def _branch(self, aggregated: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """`[s, b, C]` -> the branch output and bias, before any residual add."""
        layer = self.inner_layer
        if self.has_attention:
            out = layer.self_attention(
                layer.input_layernorm(aggregated),
                attention_mask=kwargs.get("attention_mask"),
                rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                packed_seq_params=kwargs.get("packed_seq_params"),
            )
        else:
            out = layer.mlp(layer.pre_mlp_layernorm(aggregated))
        return out[0], out[1]

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """`hidden_states [s, b, n*C]` -> `([s, b, n*C], context)`; with mHC recompute on, inside this layer's
        recompute group (`RecomputeMember`, the rule GPT's layer follows)."""
        return self._in_recompute_group(hidden_states, lambda: self._forward(hidden_states, *args, **kwargs))

    def _forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        hc = self.hyper_connection
        aggregated, (residual, h_res, h_post, _), next_h_pre = self._connect(hc, hidden_states)
        context = kwargs.get("context")
        if self.single_branch:
            y, bias = self._branch(aggregated, **kwargs)
            dropout = self.inner_layer.hidden_dropout
        else:
            out, context = self.inner_layer(aggregated, *args, **kwargs)
            y, bias, dropout = out - aggregated, None, 0.0
        if y.shape != aggregated.shape:
            raise RuntimeError(
                f"HyperConnectionHybridLayer {self.layer_number}: the branch output "
                f"{list(y.shape)} is not the shape of its input {list(aggregated.shape)}"
            )
        return self._mix(hc, h_res, residual, h_post, (y, bias), dropout, next_h_pre), context


@dataclasses.dataclass
class HybridSequenceSubmodules(TransformerLayerSubmodules):
    """The specs of an MTP depth's inner hybrid layers, in order (`layers`). A `TransformerLayerSubmodules` whose
    `self_attention` is the depth's first self-attention spec, because megatron-core's MTP layer validates its inner
    layer's mask type there (0.16 reads `submodules.self_attention`, 0.19 first requires a
    `TransformerLayerSubmodules`); a depth without attention answers with a causal stand-in. Only `layers` is built."""

    layers: list[ModuleSpec] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        attention = [spec.submodules.inner_layer.submodules.self_attention for spec in self.layers]
        attention = [a for a in attention if a is not IdentityOp]
        self.self_attention = (
            attention[0]
            if attention
            else ModuleSpec(module=IdentityOp, params={"attn_mask_type": AttnMaskType.causal})
        )


class HybridLayerSequence(MegatronModule):
    """An MTP depth's inner layers (dev's nested `HybridStack`): `HyperConnectionHybridLayer`s run in order on the
    n streams, `[s, b, n*C]` in and out, no expand or contraction of their own. Called as the depth's inner layer
    (`hidden_states=...` and the layer's keyword arguments), returns `(hidden_states, context)`."""

    def __init__(
        self, config: Any, submodules: HybridSequenceSubmodules, layer_number: int = 1, **kwargs: Any
    ):
        super().__init__(config=config)
        if not submodules.layers:
            raise ValueError("HybridLayerSequence: an MTP depth needs at least one layer")
        # One number for the depth's layers: megatron-core numbers an MTP depth's inner layer after the decoder's.
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=layer_number, **kwargs)
            for spec in submodules.layers
        )

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        context = kwargs.get("context")
        for layer in self.layers:
            hidden_states, context = layer(hidden_states, *args, **kwargs)
        return hidden_states, context


def _layer_spec(symbol: str, *, num_experts: int | None, normalization: str) -> ModuleSpec:
    """The wrapped `TransformerLayer` spec of one symbol (local modules), the other branch an `IdentityOp`."""
    experts = num_experts if symbol == MOE else None
    if symbol == MOE and not num_experts:
        raise ValueError(f"hybrid pattern symbol {MOE!r} (MoE) needs config.num_moe_experts")
    stock = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, normalization=normalization)
    sub = stock.submodules
    if symbol == ATTENTION:
        sub = dataclasses.replace(sub, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityOp)
    else:
        sub = dataclasses.replace(
            sub, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityOp
        )
    inner = dataclasses.replace(stock, submodules=sub)
    return ModuleSpec(module=HyperConnectionHybridLayer, submodules=HybridLayerSubmodules(inner_layer=inner))


def _layer_specs(config: Any, symbols: str) -> list[ModuleSpec]:
    """The hybrid layer spec of each symbol, with the config's experts and normalization."""
    normalization = getattr(config, "normalization", "LayerNorm")
    return [
        _layer_spec(sym, num_experts=getattr(config, "num_moe_experts", None), normalization=normalization)
        for sym in symbols
    ]


def hybrid_block_spec(config: Any, pattern: str, *, stage: int = 0, vp_stage: int | None = None) -> Any:
    """The `TransformerBlockSubmodules` of one pipeline chunk of `pattern`: the layers of its segment
    (chunk `vp_stage * PP + stage` under virtual stages), and the final layernorm.

    Raises:
        ValueError: the pattern's stage count is not PP (x VPP), or with PP > 1 the config's
            `pipeline_model_parallel_layout` is not `hybrid_layout(pattern)` (layer numbers follow it).
    """
    segments = parse_pattern(pattern)
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1)
    if len(segments) != pp * vpp:
        raise ValueError(
            f"hybrid pattern {pattern!r} has {len(segments)} stages; the config runs PP {pp} x VPP {vpp}"
        )
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if pp > 1 and str(layout) != hybrid_layout(pattern):  # a layout object prints as its string (0.16, 0.19)
        raise ValueError(
            f"hybrid pattern {pattern!r}: set pipeline_model_parallel_layout={hybrid_layout(pattern)!r} "
            f"(got {layout!r}) so that layer numbers follow the pattern's stages"
        )
    depths = split_mtp(pattern)[2]
    if depths != int(getattr(config, "mtp_num_layers", None) or 0):
        raise ValueError(
            f"hybrid pattern {pattern!r} has {depths} MTP depth(s); set config.mtp_num_layers={depths} "
            f"(got {getattr(config, 'mtp_num_layers', None)!r})"
        )
    chunk = (vp_stage or 0) * pp + stage
    stock = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization=getattr(config, "normalization", "LayerNorm")
    )
    return TransformerBlockSubmodules(
        layer_specs=_layer_specs(config, segments[chunk]), layer_norm=stock.submodules.input_layernorm
    )


def hybrid_mtp_block_spec(config: Any, pattern: str, *, vp_stage: int | None = None) -> Any:
    """The MTP block spec of this stage for the pattern's depths (`<main>/<mtp>/...`): each depth a
    `HyperConnectionMTPLayer` whose inner layer is the depth's pattern as a `HybridLayerSequence`; None without MTP
    depths or where this stage builds none (megatron-core puts them on the last stage)."""
    from mhc_core.megatron.mtp import get_gpt_mtp_block_spec

    _, depth_pattern, depths = split_mtp(pattern)
    if depth_pattern is None:
        return None
    inner = ModuleSpec(
        module=HybridLayerSequence,
        submodules=HybridSequenceSubmodules(layers=_layer_specs(config, depth_pattern)),
    )
    stock = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization=getattr(config, "normalization", "LayerNorm")
    )
    return get_gpt_mtp_block_spec(config, stock, vp_stage=vp_stage, inner=inner)


_LAYERS = "decoder.layers."
_SLOTS = ("self_attention_hyper_connection", "mlp_hyper_connection")


def gpt_key(key: str) -> str:
    """A hybrid model's key as the GPT's of the same weights, for a pattern of logical layers as DeepSeek-V4's
    conversion writes them (attention, then MLP or MoE: `*-*E...`): hybrid layer 2i is GPT layer i's attention
    sublayer, 2i+1 its MLP sublayer, and each layer's `hyper_connection` becomes that sublayer's (its
    `inner_layer.` prefix dropped). Keys outside `decoder.layers.` are unchanged."""
    if not key.startswith(_LAYERS):
        return key
    index, rest = key[len(_LAYERS) :].split(".", 1)
    layer, branch = divmod(int(index), 2)
    if rest.startswith("hyper_connection."):
        rest = f"{_SLOTS[branch]}." + rest[len("hyper_connection.") :]
    rest = rest.removeprefix("inner_layer.")
    return f"{_LAYERS}{layer}.{rest}"


def hybrid_key(key: str) -> str:
    """The inverse of `gpt_key` for a GPT layer's hyper connections (`decoder.layers.<i>.<slot>.*` ->
    `decoder.layers.<2i or 2i+1>.hyper_connection.*`); other keys unchanged."""
    if not key.startswith(_LAYERS):
        return key
    index, rest = key[len(_LAYERS) :].split(".", 1)
    for branch, slot in enumerate(_SLOTS):
        if rest.startswith(f"{slot}."):
            return f"{_LAYERS}{2 * int(index) + branch}.hyper_connection." + rest[len(slot) + 1 :]
    return key
