"""`HyperConnectionTransformerLayer`: a megatron-core `TransformerLayer` whose residual is n streams.

Legend: s sequence, b micro-batch, C hidden size, n residual streams.

The layer takes and returns `[s, b, n*C]`; the layernorms, the attention and the MLP see `[s, b, C]`.
Per sublayer (upstream main's data flow):

    aggregated, h_res, h_post, residual = hc(x)                      # x [s, b, n*C]
    y, bias = F(norm(aggregated))                                    # [s, b, C]
    x = hc.post_residual_bda(h_res, residual, h_post, (y, bias), hidden_dropout, training)

megatron-core 0.16.1 / 0.19.2 split `TransformerLayer.forward` into `_forward_attention` and
`_forward_mlp` (+ `_forward_pre_mlp_layernorm`, `_forward_post_mlp`); this class overrides
`_forward_attention`, `_forward_pre_mlp_layernorm`, `_forward_mlp` and `_forward_post_mlp`, and
keeps selective recompute of the layernorms and of the MLP. With `"mhc"` in `recompute_modules`
`forward` runs inside an mHC recompute group (`mhc_core.recompute`, planned by the block).

With `mhc_single_pass` (DeepSeek-V4.1) the layer takes and returns the carrier `[s, b, n*C + k]`
(`mhc_core.megatron.handoff`), and each sublayer reads the `H_pre` its predecessor left in it:

    x, h_pre = unpack(carrier)                                       # [s, b, n*C], [s, b, n]
    aggregated, h_res, h_post, h_pre_next = hc(x, previous_h_pre=h_pre)
    carrier = pack(hc.post_residual_bda(h_res, x, h_post, (y, bias), ...), h_pre_next)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import deprecate_inference_params, make_viewless_tensor
from torch import Tensor

from mhc_core.handoff import pack, unpack
from mhc_core.megatron.compat import checkpoint_without_output
from mhc_core.ops.single_pass import mix_dtype
from mhc_core.recompute import StreamRecompute

__all__ = [
    "HyperConnectionTransformerLayer",
    "HyperConnectionTransformerLayerSubmodules",
    "RecomputeMember",
    "RecomputePlan",
    "RecomputeSlot",
]

_HC_SLOTS = ("self_attention_hyper_connection", "cross_attention_hyper_connection", "mlp_hyper_connection")


@dataclass
class HyperConnectionTransformerLayerSubmodules(TransformerLayerSubmodules):
    """`TransformerLayerSubmodules` plus the three hyper-connection slots of upstream main.

    megatron-core 0.16.1 and 0.19.2 have no such fields, hence this subclass. The mHC layer needs
    the self-attention and MLP slots set (to `mhc_core.HyperConnectionModule`); the
    cross-attention slot must stay `IdentityOp`.
    """

    self_attention_hyper_connection: ModuleSpec | type = IdentityOp
    cross_attention_hyper_connection: ModuleSpec | type = IdentityOp
    mlp_hyper_connection: ModuleSpec | type = IdentityOp


class RecomputeSlot:
    """The open mHC recompute group of one chunk, handed from layer to layer during its forward."""

    def __init__(self) -> None:
        self.group: StreamRecompute | None = None


@dataclass(frozen=True, kw_only=True)
class RecomputePlan:
    """A layer's place in its chunk's mHC recompute groups (set by the block)."""

    start: bool
    """The layer's input anchors a new group."""
    end: bool
    """The group closes after this layer."""
    slot: RecomputeSlot


class _Streams(NamedTuple):
    """What a sublayer's post/residual mix needs besides the sublayer output."""

    residual: Tensor
    """`[s, b, n*C]`, the sublayer input."""
    h_res: Tensor
    """`[s, b, n, n]`."""
    h_post: Tensor
    """`[s, b, n]`."""
    next_h_pre: Tensor | None = None
    """Single-pass form: `[s, b, n]`, the `H_pre` handed on with the output."""


class _Connection(NamedTuple):
    """A sublayer's connection on its input: the branch input and what its mix needs."""

    aggregated: Tensor
    """`[s, b, C]`."""
    streams: _Streams
    next_h_pre: Tensor | None
    """Single-pass form: `[s, b, n]`, this sublayer's H_pre for the next one."""


class RecomputeMember:
    """The base of every mHC layer kind (GPT's `HyperConnectionTransformerLayer`, the hybrid stack's
    `HyperConnectionHybridLayer`), and the rule they share under mHC recompute: the forward runs inside its chunk's
    recompute group and its n-stream mixes are the group's steps; the block plans the groups (`RecomputePlan`)."""

    config: Any
    training: bool
    mhc_recompute_plan: RecomputePlan | None = None
    """Set by `HyperConnectionTransformerBlock` when `"mhc"` is in `recompute_modules`; a layer
    used on its own with mHC recompute on is a group by itself."""
    _mhc_group: StreamRecompute | None = None

    def _in_recompute_group(self, hidden_states: Tensor, run: Any) -> Any:
        """`run()` (the layer's forward on `hidden_states [s, b, n*C]`), inside this layer's recompute group when
        mHC recompute is on and autograd records: the n-stream states the group produces are dropped from
        autograd's saved tensors and rebuilt in backward (`mhc_core.recompute`); the group closes at the plan's
        `end`, or when the forward raises."""
        plan = self.mhc_recompute_plan
        if plan is None and getattr(self.config, "mhc_recompute", False):
            plan = RecomputePlan(start=True, end=True, slot=RecomputeSlot())
        if plan is None or not torch.is_grad_enabled():
            return run()
        group = plan.slot.group
        if plan.start or group is None or not group.continues_from(hidden_states):
            if group is not None:
                group.close()  # a group that should have ended: let go of its states
            group = plan.slot.group = StreamRecompute(hidden_states)
        self._mhc_group = group
        ended = plan.end
        try:
            with group.saving():
                return run()
        except BaseException:
            ended = True  # a failed forward leaves no open group holding its states
            raise
        finally:
            self._mhc_group = None
            if ended:
                group.close()
                plan.slot.group = None

    def _connect(self, hc: Any, hidden_states: Tensor) -> _Connection:
        """The sublayer's connection on its input: `hc(x)`, or in the single-pass form `hc(x, previous_h_pre=...)`
        on the carrier's streams and mix (`residual` is then the streams, a view of the carrier)."""
        if not getattr(self.config, "mhc_single_pass", False):
            aggregated, h_res, h_post, residual = hc(hidden_states)
            return _Connection(aggregated, _Streams(residual, h_res, h_post), None)
        streams, h_pre = unpack(hidden_states, hc.n, mix_dtype(hc.numerics, hidden_states.dtype))
        aggregated, h_res, h_post, next_h_pre = hc(streams, previous_h_pre=h_pre)
        return _Connection(aggregated, _Streams(streams, h_res, h_post), next_h_pre)

    def _mix(
        self,
        hc: Any,
        h_res: Tensor,
        residual: Tensor,
        h_post: Tensor,
        output_with_bias: tuple[Tensor, Tensor | None],
        dropout: float,
        carry: Tensor | None = None,
    ) -> Tensor:
        """`hc.post_residual_bda` with hidden dropout `dropout`, as a recompute step when a group is open; with
        `carry` (the single-pass `H_pre` handed on) the carrier of its output and `carry`."""
        if self._mhc_group is None:
            out = hc.post_residual_bda(h_res, residual, h_post, output_with_bias, dropout, self.training)
            return out if carry is None else pack(out, carry)
        return self._mhc_group.post_residual_bda(
            hc, h_res, residual, h_post, output_with_bias, dropout, self.training, carry=carry
        )


def _is_identity(spec: Any) -> bool:
    module = get_module(spec) if isinstance(spec, ModuleSpec) else spec
    return isinstance(module, type) and issubclass(module, IdentityOp)


def _check_norm_output(out: Any, name: str) -> Tensor:
    if isinstance(out, (tuple, list)):
        raise ValueError(
            f"HyperConnectionTransformerLayer: {name} returned a {type(out).__name__} of "
            f"{len(out)} (a norm that also returns the residual); mHC needs a norm returning one "
            "tensor [s, b, C]"
        )
    return out


class HyperConnectionTransformerLayer(RecomputeMember, TransformerLayer):
    """`TransformerLayer` with mHC on the self-attention and MLP sublayers: `[s, b, n*C]` in and out.

    The MLP may be megatron-core's `MoELayer` (upstream dev's data flow): the MLP-side hyper connection
    aggregates the streams, the router and the experts see `[s, b, C]`, and the n-stream update takes the MoE
    output as it takes a dense MLP's (the router's aux loss rides on that output into the backward).

    Built from a spec whose submodules are `HyperConnectionTransformerLayerSubmodules`; the two
    hyper connections are built with `build_module(slot, config=config, layer_number=...)`.

    Raises:
        ValueError: `config.enable_mhc_connections` is off, a hyper-connection slot is missing or
            `IdentityOp`, or the cross-attention slot is set.
        NotImplementedError: a cross-attention sublayer.
    """

    def __init__(self, config: Any, submodules: TransformerLayerSubmodules, *args: Any, **kwargs: Any):
        self._check_spec(config, submodules)
        super().__init__(config, submodules, *args, **kwargs)
        if not isinstance(self.cross_attention, IdentityOp):
            raise NotImplementedError(
                "HyperConnectionTransformerLayer: cross-attention is not supported with mHC"
            )
        self.self_attention_hyper_connection = build_module(
            submodules.self_attention_hyper_connection, config=self.config, layer_number=self.layer_number
        )
        self.cross_attention_hyper_connection = build_module(submodules.cross_attention_hyper_connection)
        self.mlp_hyper_connection = build_module(
            submodules.mlp_hyper_connection, config=self.config, layer_number=self.layer_number
        )
        if not self.config.use_cpu_initialization and torch.cuda.is_available():
            device = torch.cuda.current_device()
            self.self_attention_hyper_connection.to(device)
            self.mlp_hyper_connection.to(device)

    @staticmethod
    def _check_spec(config: Any, submodules: Any) -> None:
        who = "HyperConnectionTransformerLayer"
        if not getattr(config, "enable_mhc_connections", False):
            raise ValueError(
                f"{who}: config.enable_mhc_connections must be True (use TransformerLayer without mHC)"
            )
        missing = [s for s in _HC_SLOTS if not hasattr(submodules, s)]
        if missing:
            raise ValueError(
                f"{who}: submodules {type(submodules).__name__} lack {missing}; "
                "use HyperConnectionTransformerLayerSubmodules"
            )
        for slot in ("self_attention_hyper_connection", "mlp_hyper_connection"):
            if _is_identity(getattr(submodules, slot)):
                raise ValueError(f"{who}: submodules.{slot} must be a hyper connection, got IdentityOp")
        if not _is_identity(submodules.cross_attention_hyper_connection):
            raise ValueError(
                f"{who}: submodules.cross_attention_hyper_connection must be IdentityOp, "
                f"got {submodules.cross_attention_hyper_connection!r}"
            )

    @property
    def num_residual_streams(self) -> int:
        """n."""
        return self.self_attention_hyper_connection.n

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The stock forward; with mHC recompute on, run inside this layer's recompute group (`RecomputeMember`)."""
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return self._in_recompute_group(
            hidden_states, lambda: super(HyperConnectionTransformerLayer, self).forward(*args, **kwargs)
        )

    def _post_bda(
        self,
        hc: Any,
        streams: _Streams,
        output_with_bias: tuple[Tensor, Tensor | None],
        next_h_pre: Tensor | None,
    ) -> Tensor:
        """`hc.post_residual_bda` with the layer's hidden dropout, as a recompute step when a group is open (the
        carrier with `next_h_pre` in the single-pass form)."""
        return self._mix(
            hc,
            streams.h_res,
            streams.residual,
            streams.h_post,
            output_with_bias,
            self.hidden_dropout,
            next_h_pre,
        )

    def _forward_attention(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        rotary_pos_emb: Tensor | None = None,
        rotary_pos_cos: Tensor | None = None,
        rotary_pos_sin: Tensor | None = None,
        rotary_pos_cos_sin: Tensor | None = None,
        attention_bias: Tensor | None = None,
        inference_context: Any | None = None,
        packed_seq_params: Any | None = None,
        sequence_len_offset: Tensor | None = None,
        padding_mask: Tensor | None = None,
        *,
        inference_params: Any | None = None,
        **unknown: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """Self-attention sublayer: `[s, b, n*C] -> ([s, b, n*C], context)`.

        Keyword arguments newer megatron-core versions may pass are accepted when None and
        rejected (TypeError naming them) otherwise, so nothing is dropped silently.
        """
        _reject_unknown(unknown, "_forward_attention")
        inference_context = deprecate_inference_params(inference_context, inference_params)
        hc = self.self_attention_hyper_connection
        aggregated, streams, next_h_pre = self._connect(hc, hidden_states)

        if self.recompute_input_layernorm:
            self.input_layernorm_checkpoint = checkpoint_without_output(self.config)
            normed = self.input_layernorm_checkpoint.checkpoint(self.input_layernorm, aggregated)
        else:
            normed = self.input_layernorm(aggregated)
        normed = _check_norm_output(normed, "input_layernorm")

        attention_output_with_bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if self.recompute_input_layernorm:
            self.input_layernorm_checkpoint.discard_output_and_register_recompute(
                attention_output_with_bias[0]
            )
        attention_output_with_bias = self._sandwich_norm(
            "post_self_attn_layernorm", attention_output_with_bias
        )

        with self.bias_dropout_add_exec_handler():
            hidden_states = self._post_bda(hc, streams, attention_output_with_bias, next_h_pre)
        return hidden_states, context

    def _sandwich_norm(
        self, name: str, output_with_bias: tuple[Tensor, Tensor | None]
    ) -> tuple[Tensor, Tensor | None]:
        """Newer megatron-core layers may carry a "sandwich" norm of the sublayer output `[s, b, C]`
        (`post_self_attn_layernorm`, `post_mlp_layernorm`), applied before the residual add; 0.16.1
        has neither attribute."""
        norm = getattr(self, name, None)
        if norm is None or isinstance(norm, IdentityOp):
            return output_with_bias
        return (_check_norm_output(norm(output_with_bias[0]), name), *output_with_bias[1:])

    def _forward_mlp(
        self,
        hidden_states: Tensor,
        inference_context: Any | None = None,
        padding_mask: Tensor | None = None,
        **unknown: Any,
    ) -> Tensor:
        """MLP sublayer: `[s, b, n*C] -> [s, b, n*C]`."""
        _reject_unknown(unknown, "_forward_mlp")
        aggregated, streams, next_h_pre = self._connect(self.mlp_hyper_connection, hidden_states)
        normed = _check_norm_output(self._forward_pre_mlp_layernorm(aggregated), "pre_mlp_layernorm")

        if self.recompute_mlp:
            if self.config.fp8 or self.config.fp4:
                from megatron.core.extensions.transformer_engine import te_checkpoint

                mlp_output_with_bias = te_checkpoint(
                    self.mlp,
                    False,
                    tensor_parallel.random.get_cuda_rng_tracker,
                    self.pg_collection.tp,
                    normed,
                    padding_mask=padding_mask,
                )
            else:
                mlp_output_with_bias = self._checkpointed_mlp(normed, padding_mask)
        else:
            mlp_output_with_bias = self.mlp(normed, padding_mask=padding_mask)
        return self._forward_post_mlp(mlp_output_with_bias, streams._replace(next_h_pre=next_h_pre))

    def _forward_pre_mlp_layernorm(self, hidden_states: Tensor) -> Tensor:
        """Pre-MLP layernorm of the aggregated `[s, b, C]`, checkpointed under selective "layernorm" recompute.

        Same as the stock method (activation offloading is rejected with mHC), except that the
        checkpoint is told the real fp8 setting (`compat.checkpoint_without_output`): megatron-core
        0.16.1's `CheckpointWithoutOutput()` default reads as fp8 on and needs TE.
        """
        if self.recompute_pre_mlp_layernorm:
            self.pre_mlp_norm_checkpoint = checkpoint_without_output(self.config)
            return self.pre_mlp_norm_checkpoint.checkpoint(self.pre_mlp_layernorm, hidden_states)
        return self.pre_mlp_layernorm(hidden_states)

    def _checkpointed_mlp(self, normed: Tensor, padding_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The MLP under `tensor_parallel.checkpoint`, with its bias returned outside the checkpoint.

        The stock code checkpoints `self.mlp` whole, so the bias it returns (`linear_fc2.bias`, a
        parameter) leaves `CheckpointFunction` as an output; with torch 2.13 that gives the
        parameter itself the checkpoint's grad_fn, and the recompute in backward then recurses
        without end. Only the output tensor goes through the checkpoint here; the bias reaches
        the bias-dropout-add directly, so its gradient is the same.
        """
        bias: list[Tensor | None] = [None]

        def run(x: Tensor) -> Tensor:
            out, bias[0] = self.mlp(x, padding_mask=padding_mask)
            return out

        out = tensor_parallel.checkpoint(run, False, normed)
        return out, bias[0]

    def _forward_post_mlp(
        self, mlp_output_with_bias: tuple[Tensor, Tensor | None], residual: _Streams
    ) -> Tensor:
        """Post/residual mix of the MLP output: `[s, b, n*C]`. `residual` carries the mHC coefficients."""
        if not isinstance(residual, _Streams):
            raise TypeError(
                "HyperConnectionTransformerLayer._forward_post_mlp: residual must carry the mHC "
                f"coefficients (from _forward_mlp), got {type(residual).__name__}"
            )
        if self.recompute_pre_mlp_layernorm:
            self.pre_mlp_norm_checkpoint.discard_output_and_register_recompute(mlp_output_with_bias[0])
        mlp_output_with_bias = self._sandwich_norm("post_mlp_layernorm", mlp_output_with_bias)
        with self.bias_dropout_add_exec_handler():
            hidden_states = self._post_bda(
                self.mlp_hyper_connection, residual, mlp_output_with_bias, residual.next_h_pre
            )
        return make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )

    def get_layer_static_inputs(self, seq_length: int, micro_batch_size: int) -> dict[str, Tensor]:
        """Static CUDA-graph inputs; `hidden_states` is `[s', b, n*C]` (the carrier `[s', b, n*C + k]` single-pass)."""
        from mhc_core.megatron.handoff import carrier_width, is_single_pass

        static_inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        hs = static_inputs["hidden_states"]
        width = (
            carrier_width(self.config, hs.dtype)
            if is_single_pass(self.config)
            else self.num_residual_streams * hs.shape[-1]
        )
        static_inputs["hidden_states"] = torch.ones(
            (*hs.shape[:-1], width),
            dtype=hs.dtype,
            device=hs.device,
            requires_grad=hs.requires_grad,
        )
        return static_inputs

    def _get_submodules_under_cudagraphs(self) -> list[torch.nn.Module]:
        """The stock list plus the hyper connection of each sublayer captured whole (the stock rule:
        `attn`; `mlp` for a dense layer, `moe` for an MoE one). The scope is megatron-core 0.19's
        `cuda_graph_modules` (its config moves a deprecated `cuda_graph_scope` there and clears it),
        else 0.16's `cuda_graph_scope`; members are compared by name, as the two enums differ."""
        submodules = super()._get_submodules_under_cudagraphs()
        scope = getattr(self.config, "cuda_graph_modules", None) or self.config.cuda_graph_scope
        if not scope or isinstance(scope, str):
            return submodules  # the whole layer ("full" or empty), hyper connections included
        names = {getattr(s, "name", s) for s in scope}
        if "attn" in names:
            submodules.append(self.self_attention_hyper_connection)
        if ("moe" if self.is_moe_layer else "mlp") in names:
            submodules.append(self.mlp_hyper_connection)
        return submodules


def _reject_unknown(kwargs: dict[str, Any], where: str) -> None:
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise TypeError(
            f"HyperConnectionTransformerLayer.{where}: unsupported arguments {given} "
            "(a newer megatron-core? see mhc_core.megatron.compat)"
        )
