"""Pipeline parallelism with mHC: n-stream P2P shapes for megatron-core's schedules.

With mHC the hidden state between stages is `[s', b, n*C]` (s' = s / CP, / TP with sequence
parallelism). Rules (see DESIGN.md "Pipeline parallelism"):

- 1F1B: receive `[s', b, n*C]` on every rank but the first, send it on every rank but the last.
- Interleaved (VPP): `n*C` on every hop when PP > 1 (only chunk (pp0, vp0) expands and only
  chunk (ppLast, vpLast) contracts).
- Without mHC (or PP = 1): exactly megatron-core's shapes.
- Single-pass (`mhc_single_pass`): the carrier `[s', b, n*C + k]` wherever the streams go: the H_pre the next
  stage's first sublayer aggregates with rides behind the streams in the pipeline dtype, `k = n` when the mix
  has that dtype and `k = 2n` for an fp32 mix in a bf16 / fp16 pipeline (its bytes, not a rounding:
  `mhc_core.handoff`), so every stage boundary carries it unrounded, forward and backward.

`enable_mhc_pipeline()` installs this into megatron-core's schedules without editing
site-packages, explicitly and reversibly:

- `schedules.forward_backward_pipelining_without_interleaving` is wrapped so that, for an mHC
  config, it passes an `adjust_tensor_shapes_fn` (megatron-core's own extension point) returning
  the n-stream recv / send shapes; a caller's own `adjust_tensor_shapes_fn` is applied after it.
- `schedules.P2PCommunicator` is replaced by `NStreamP2PCommunicator`, which widens a `[s', b, C]`
  transfer to `[s', b, n*C]` for an mHC config with PP > 1 (the interleaved schedule has no
  shape hook). A caller who builds their own communicator passes an `NStreamP2PCommunicator`.

Use `get_forward_backward_func()` after enabling (it looks the schedules up at call time).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication, schedules
from megatron.core.utils import get_model_config

from mhc_core.checks import check_int

__all__ = [
    "NStreamP2PCommunicator",
    "disable_mhc_pipeline",
    "enable_mhc_pipeline",
    "get_tensor_shapes",
    "interleaved_tensor_shape",
    "is_mhc_pipeline_enabled",
    "mhc_pipeline",
    "mhc_width",
]

_STOCK_GET_TENSOR_SHAPES = schedules.get_tensor_shapes
_STOCK_1F1B = schedules.forward_backward_pipelining_without_interleaving
_STOCK_P2P = p2p_communication.P2PCommunicator
_LOCK = threading.Lock()
_ENABLED = False


def mhc_width(config: Any) -> int:
    """The hidden width between stages: n*C with mHC, C without; single-pass, the carrier's `n*C + k` for the
    config's pipeline dtype (`mhc_core.megatron.handoff.boundary_width`)."""
    if getattr(config, "enable_mhc_connections", False):
        if getattr(config, "mhc_single_pass", False):
            from mhc_core.megatron.handoff import boundary_width

            dtype = (
                getattr(config, "pipeline_dtype", None)
                or getattr(config, "params_dtype", None)
                or torch.float32
            )
            return boundary_width(config, dtype)
        return config.hidden_size * int(getattr(config, "mhc_num_residual_streams", 1))
    return config.hidden_size


def get_tensor_shapes(
    *,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    config: Any,
    tp_group: Any,
    cp_group: Any,
    pp_group: Any = None,
    is_recv: bool = True,
) -> list[tuple[int, int, int]]:
    """1F1B P2P shapes of this rank, n-stream aware (the signature of upstream PR #4946).

    The sequence dimension comes from megatron-core's own `get_tensor_shapes` (s' = s / CP,
    / TP with SP). The width is n*C when mHC is on, `pp_group.size() > 1`, and this is a
    receive on a rank > 0 or a send on a rank < last; C otherwise, and C when `pp_group` is None.

    Returns:
        `[(s', b, width)]`.
    """
    base = _STOCK_GET_TENSOR_SHAPES(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
        tp_group=tp_group,
        cp_group=cp_group,
    )
    if pp_group is None or pp_group.size() == 1 or not getattr(config, "enable_mhc_connections", False):
        return base
    rank, size = pp_group.rank(), pp_group.size()
    wide = (is_recv and rank > 0) or (not is_recv and rank < size - 1)
    if not wide:
        return base
    return [(s, b, mhc_width(config)) for (s, b, _c) in base]


def interleaved_tensor_shape(
    *, seq_length: int, micro_batch_size: int, config: Any, tp_size: int, cp_size: int, pp_size: int
) -> tuple[int, int, int]:
    """The one shape of every hop of the interleaved schedule: `[s / CP (/ TP with SP), b, w]`,
    w = n*C with mHC and PP > 1, else C."""
    for name, v in (
        ("seq_length", seq_length),
        ("micro_batch_size", micro_batch_size),
        ("tp_size", tp_size),
        ("cp_size", cp_size),
        ("pp_size", pp_size),
    ):
        check_int(v, name=name, op="interleaved_tensor_shape")
    s = seq_length // cp_size
    if getattr(config, "sequence_parallel", False):
        s //= tp_size
    width = mhc_width(config) if pp_size > 1 else config.hidden_size
    return (s, micro_batch_size, width)


class NStreamP2PCommunicator(p2p_communication.P2PCommunicator):  # the stock class (_STOCK_P2P)
    """megatron-core's `P2PCommunicator` that carries `[s', b, n*C]` for an mHC config with PP > 1."""

    def _widen(self, tensor_shape):
        config = self.config
        if tensor_shape is None or not getattr(config, "enable_mhc_connections", False):
            return tensor_shape
        if self.pp_group.size() <= 1 or len(tensor_shape) == 0:
            return tensor_shape
        if tensor_shape[-1] != config.hidden_size:
            return tensor_shape  # already n*C (1F1B with the adjust hook), or not a hidden state
        return (*tuple(tensor_shape)[:-1], mhc_width(config))

    def _communicate(self, *, tensor_shape, **kwargs):
        return super()._communicate(tensor_shape=self._widen(tensor_shape), **kwargs)


def _groups(p2p_communicator, pg_collection):
    if pg_collection is not None:
        return pg_collection.pp, pg_collection.tp, pg_collection.cp
    pp = p2p_communicator.pp_group if p2p_communicator is not None else None
    return (
        pp or parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_context_parallel_group(),
    )


@functools.wraps(_STOCK_1F1B)
def _mhc_1f1b(
    *,
    model,
    seq_length,
    micro_batch_size,
    decoder_seq_length=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    **kwargs,
):
    config = get_model_config(model[0] if isinstance(model, list) else model)
    if getattr(config, "enable_mhc_connections", False):
        pp_group, tp_group, cp_group = _groups(p2p_communicator, pg_collection)
        shape_kw = dict(
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            config=config,
            tp_group=tp_group,
            cp_group=cp_group,
            pp_group=pp_group,
        )
        recv = get_tensor_shapes(**shape_kw, is_recv=True)
        send = get_tensor_shapes(**shape_kw, is_recv=False)
        user_fn = adjust_tensor_shapes_fn

        def adjust_tensor_shapes_fn(_recv, _send):
            return user_fn(recv, send) if user_fn is not None else (recv, send)

    return _STOCK_1F1B(
        model=model,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
        **kwargs,
    )


def _install(enabled: bool) -> None:
    """Point megatron-core's schedules at the n-stream (True) or the stock (False) 1F1B and P2P."""
    global _ENABLED
    with _LOCK:
        schedules.forward_backward_pipelining_without_interleaving = _mhc_1f1b if enabled else _STOCK_1F1B
        schedules.P2PCommunicator = NStreamP2PCommunicator if enabled else _STOCK_P2P
        _ENABLED = enabled


def enable_mhc_pipeline() -> None:
    """Install the n-stream shapes into megatron-core's schedules (idempotent)."""
    _install(True)


def disable_mhc_pipeline() -> None:
    """Restore megatron-core's stock schedules (idempotent)."""
    _install(False)


def is_mhc_pipeline_enabled() -> bool:
    """Whether `enable_mhc_pipeline()` is in effect."""
    return _ENABLED and schedules.P2PCommunicator is NStreamP2PCommunicator


@contextlib.contextmanager
def mhc_pipeline() -> Iterator[None]:
    """`with mhc_pipeline(): ...` enables the n-stream schedules and restores the previous state."""
    was = is_mhc_pipeline_enabled()
    enable_mhc_pipeline()
    try:
        yield
    finally:
        if not was:
            disable_mhc_pipeline()
