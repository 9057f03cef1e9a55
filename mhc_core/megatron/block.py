"""`HyperConnectionTransformerBlock`: the block boundary of mHC, keyed on `pre_process` / `post_process`.

Legend: s sequence, b micro-batch, C hidden size, n residual streams.

- Entry, in the chunk with `pre_process` (first pipeline stage, first virtual stage): the embedding
  output `[s, b, C]` is expanded to n copies `[s, b, n*C]` (`mhc_core.ops.expand`). Every other
  chunk receives `[s, b, n*C]` through `set_input_tensor`.
- Exit, in the chunk with `post_process` (last stage, last virtual stage): the streams are
  contracted to `[s, b, C]` (mean, `mhc_core.ops.contract`; or, with `megatron_dev` and
  `mhc_learned_contraction`, the learned contraction with block parameters `hc_head_fn`,
  `hc_head_base`, `hc_head_scale`), right before the final layernorm when this chunk has one,
  else at the end of the forward. So the output layer always receives `[s, b, C]`: also with
  `post_layer_norm=False` (where upstream main hands it `[s, b, n*C]`) and when the chunk holds
  zero transformer layers. Every other chunk returns `[s, b, n*C]`. The final layernorm stays in the
  post_process chunk also with multi-token prediction (megatron-core moves it to the chunk of the
  last decoder layer there), and the streams before the contraction are kept in `mtp_streams` for
  the MTP block (`mhc_core.megatron.mtp`).

In the single-pass form (`mhc_single_pass`) the entry packs the identity mix (stream 0) behind the expanded
streams and every chunk passes the carrier `[s, b, n*C + k]` on (`mhc_core.megatron.handoff`); the exit
aggregates the streams with the mix the last layer left there (no learned head).

The stock forward runs unchanged in between (recompute, quantization contexts, offloading); the
contraction before the final layernorm is a forward pre-hook on `final_layernorm` that acts only
while this block's own forward runs (a direct call `block.final_layernorm(x)` is the plain norm),
so the state-dict keys stay the stock ones.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import WrappedTensor, make_viewless_tensor
from torch import Tensor, nn

from mhc_core.config import PARAM_DTYPE
from mhc_core.megatron.handoff import boundary_width, enter, is_single_pass, leave, receive, send
from mhc_core.megatron.layer import (
    HyperConnectionTransformerLayer,
    RecomputeMember,
    RecomputePlan,
    RecomputeSlot,
)
from mhc_core.ops import contract, expand, learned_contract
from mhc_core.precision import KeepInFp32Mixin, mark_keep_in_fp32

__all__ = ["HyperConnectionTransformerBlock", "StreamContraction"]


class StreamContraction:
    """The contraction of the n streams at an exit, `[s, b, n*C] -> [s, b, C]`: the mean, or with
    `mhc_learned_contraction` the learned one with its own `hc_head_fn`, `hc_head_base`, `hc_head_scale`.

    Shared by the block's exit and each MTP depth's; the class using it sets `config`,
    `num_residual_streams` and `learned_contraction`, and calls `_build_learned_contraction` when learned.
    """

    config: Any
    num_residual_streams: int
    learned_contraction: bool

    def _build_learned_contraction(self, config: Any) -> None:
        """`hc_head_fn [n, n*C]` (xavier), `hc_head_base [n]` (0), `hc_head_scale [1]` (1), fp32 and
        kept fp32 under `Float16Module` as upstream dev's, named as there (`decoder.hc_head_fn`, ...)."""
        n, c = self.num_residual_streams, config.hidden_size
        device = None
        if not config.use_cpu_initialization and torch.cuda.is_available():
            device = torch.cuda.current_device()
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * c, dtype=PARAM_DTYPE, device=device))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=PARAM_DTYPE, device=device))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=PARAM_DTYPE, device=device))
        if getattr(config, "perform_initialization", True):
            nn.init.xavier_uniform_(self.hc_head_fn)
        else:
            nn.init.zeros_(self.hc_head_fn)
        for p in (self.hc_head_fn, self.hc_head_base, self.hc_head_scale):
            mark_keep_in_fp32(p)
            if getattr(config, "sequence_parallel", False):
                p.sequence_parallel = True  # type: ignore[attr-defined]  # megatron-core's marker on a Parameter

    def contract_streams(self, hidden_states: Tensor) -> Tensor:
        """`[s, b, n*C] -> [s, b, C]`: mean of the streams, or the learned contraction."""
        n = self.num_residual_streams
        if self.learned_contraction:
            return learned_contract(
                hidden_states,
                self.hc_head_fn,
                self.hc_head_base,
                self.hc_head_scale,
                n,
                self.config.layernorm_epsilon,
            )
        return contract(hidden_states, n)


class HyperConnectionTransformerBlock(StreamContraction, KeepInFp32Mixin, TransformerBlock):
    """`TransformerBlock` that expands to n residual streams on entry and contracts on exit.

    Same constructor as `TransformerBlock`. With `config.enable_mhc_connections` off it is the
    stock block. With it on, every layer must be a `HyperConnectionTransformerLayer`.

    Raises:
        ValueError: mHC is on and a layer is not a `HyperConnectionTransformerLayer`.
    """

    def __init__(self, config: Any, spec: Any, *args: Any, **kwargs: Any):
        super().__init__(config, spec, *args, **kwargs)
        self.mhc_enabled = bool(getattr(config, "enable_mhc_connections", False))
        self._contract_hook = None
        self._in_forward = False
        self.mtp_streams: Tensor | None = None
        """With MTP: the streams `[s, b, n*C]` of the last forward before their contraction (the model takes them)."""
        if not self.mhc_enabled:
            return
        self.num_residual_streams = int(config.mhc_num_residual_streams)
        for i, layer in enumerate(self.layers):
            if not isinstance(
                layer, RecomputeMember
            ):  # the mHC layer kinds' common base (no import of hybrid)
                raise ValueError(
                    f"HyperConnectionTransformerBlock: layers[{i}] is a {type(layer).__name__}, but "
                    "config.enable_mhc_connections=True needs HyperConnectionTransformerLayer "
                    "(build the spec with enable_mhc=True) or HyperConnectionHybridLayer (mhc_core.megatron.hybrid)"
                )
        if getattr(config, "mhc_recompute", False):
            self._plan_mhc_recompute(config)
        self.learned_contraction = bool(getattr(config, "mhc_learned_contraction", False))
        if self.post_process and self.learned_contraction:
            self._build_learned_contraction(config)
        if self.final_layernorm is not None:
            self._contract_hook = self.final_layernorm.register_forward_pre_hook(
                self._contract_before_final_layernorm
            )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        """The stock block's sharded state dict plus the block's own parameters (the learned exit's `hc_head_*`):
        released megatron-core's block saves its children only, so a checkpoint lost them and the optimizer
        found parameters it could not map (upstream dev's block saves them the same way). A hybrid stack's layers
        differ in kind (attention, MLP, MoE), so their tensors are keyed per layer (`non_homogeneous_layers`, as
        megatron-core does for heterogeneous specs): one tensor stacked over all layers would miss the layers of
        the other kinds."""
        if any(
            not isinstance(layer, HyperConnectionTransformerLayer) for layer in self.layers
        ):  # hybrid layers
            metadata = {**(metadata or {}), "non_homogeneous_layers": True}
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        local: dict[str, Any] = {}
        self._save_to_state_dict(local, "", keep_vars=True)
        if local:
            from megatron.core import parallel_state as ps
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(
                with_context_parallel=True
            )
            out.update(
                make_sharded_tensors_for_checkpoint(
                    local,
                    prefix,
                    sharded_offsets=sharded_offsets,
                    tp_group=getattr(self, "tp_group", None),
                    dp_cp_group=dp_cp,
                )
            )
        return out

    def _plan_mhc_recompute(self, config: Any) -> None:
        """Group this chunk's layers for mHC recompute: `mhc_recompute_layer_num` per group (None:
        all), the chunk's last layer always ends a group (`mhc_core.recompute`)."""
        count = len(self.layers)
        per_group = config.mhc_recompute_layer_num or max(count, 1)
        slot = RecomputeSlot()
        for i, layer in enumerate(self.layers):
            layer.mhc_recompute_plan = RecomputePlan(
                start=i % per_group == 0, end=(i + 1) % per_group == 0 or i == count - 1, slot=slot
            )

    def has_final_layernorm_in_this_stage(self) -> bool:
        """With mHC the final layernorm sits in the post_process chunk, with the contraction it follows,
        also with MTP (where megatron-core moves it to the chunk of the last decoder layer): so the
        streams, not a contracted tensor, cross every stage boundary, and the MTP depths on the
        post_process chunk receive them."""
        if getattr(self.config, "enable_mhc_connections", False):
            return bool(self.submodules.layer_norm and self.post_process and self.post_layer_norm)
        return bool(super().has_final_layernorm_in_this_stage())

    def _exit(self, hidden_states: Tensor) -> Tensor:
        """The contraction at the block's exit; with MTP the streams are kept for the MTP block first; single-pass,
        the carrier's streams aggregated with its mix."""
        if is_single_pass(self.config):
            return leave(self.config, hidden_states)
        if getattr(self.config, "mtp_num_layers", None):
            self.mtp_streams = hidden_states
        return self.contract_streams(hidden_states)

    def _contract_before_final_layernorm(
        self, module: nn.Module, args: tuple[Any, ...]
    ) -> tuple[Any, ...] | None:
        if not self._in_forward:
            return None  # a direct call of the norm, not the block's exit
        return (self._exit(args[0]), *args[1:])

    def _check_entry(self, hidden_states: Tensor | None) -> None:
        """`ValueError` naming the chunk's role, n, C and the shape, unless the chunk receives `[s, b, C]`
        (pre_process) or `[s, b, n*C]` (its `input_tensor`, every later chunk): also for chunks with zero
        layers, which would otherwise pass a wrong width on or contract it."""
        n, c = self.num_residual_streams, self.config.hidden_size
        if self.pre_process:
            t, width, what = hidden_states, c, "[s, b, C] (the embedding output)"
        else:
            t, width, what = (
                getattr(self, "input_tensor", None),
                n * c,
                "[s, b, n*C] (the streams received from the previous stage)",
            )
            if is_single_pass(self.config) and isinstance(t, Tensor):
                width = boundary_width(self.config, t.dtype)
                what = (
                    f"[s, b, n*C + k] (the single-pass carrier received from the previous stage, {t.dtype})"
                )
        if isinstance(t, Tensor) and (t.dim() != 3 or t.shape[-1] != width):
            role = "the pre_process chunk" if self.pre_process else "a chunk after the first"
            raise ValueError(
                f"HyperConnectionTransformerBlock ({role}, n = {n}, C = {c}, {len(self.layers)} layers): "
                f"its input must be {what}, last dim {width}; got {list(t.shape)}"
            )

    def forward(self, hidden_states: Tensor | WrappedTensor | None, *args: Any, **kwargs: Any) -> Tensor:
        """`[s, b, C]` (pre_process chunk) or the received `[s, b, n*C]` in; `[s, b, C]` out of the
        post_process chunk, `[s, b, n*C]` out of every other chunk (single-pass: the carrier `[s, b, n*C + k]`
        for `[s, b, n*C]`)."""
        if not self.mhc_enabled:
            return super().forward(hidden_states, *args, **kwargs)
        if self.pre_process and isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        self._check_entry(hidden_states)
        if self.pre_process:
            hidden_states = expand(hidden_states, self.num_residual_streams)
            if is_single_pass(self.config):
                hidden_states = enter(self.config, hidden_states)
        self.mtp_streams = None
        self._in_forward = True
        received = getattr(self, "input_tensor", None)
        single = is_single_pass(self.config)
        if single and not self.pre_process and isinstance(received, Tensor):
            self.input_tensor = receive(self.config, received)  # the carrier its layers read
        try:
            output = super().forward(hidden_states, *args, **kwargs)
        finally:
            self._in_forward = False
            if single and not self.pre_process and isinstance(received, Tensor):
                self.input_tensor = received
        if single and not self.post_process:
            output = send(self.config, output)
        if self.post_process and self.final_layernorm is None:
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"HyperConnectionTransformerBlock: the stock forward returned {type(output).__name__}, "
                    "expected the hidden states tensor; mhc_core.megatron.compat needs updating"
                )
            output = make_viewless_tensor(inp=self._exit(output), requires_grad=True, keep_graph=True)
        return output
