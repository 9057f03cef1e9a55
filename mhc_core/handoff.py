"""The single-pass handoff: the streams and the mix the next sublayer aggregates with, as one tensor.

Legend: s sequence, b micro-batch, C hidden size, n residual streams, k handoff channels.

In the single-pass form (`mhc_core.forms`) every sublayer hands two things on: the streams `[s, b, n*C]` and
the `H_pre [s, b, n]` the next sublayer aggregates with. Between layers, recompute chunks and pipeline stages
they travel as one tensor, the *carrier* `[s, b, n*C + k]`: the streams, then the mix in the last `k` channels.
One tensor is what megatron-core's layers pass on, its activation checkpoints save and its P2P sends (one shape,
one dtype per hop), so the mix crosses all of them exactly as the streams do, with nothing kept on a module.

The mix keeps its own dtype (`mhc_core.ops.mix_dtype`: fp32 under `fp32_coefficients`) whatever the streams':
where it is wider than the streams (fp32 behind bf16 streams) its bytes are stored as `k = n * 4 / 2 = 2n`
channels of the streams' dtype (a bit-for-bit reinterpretation, `Tensor.view(dtype)`), so the mix arrives
unrounded and a pipelined run equals the single process bit for bit; else `k = n` and the mix is stored as it
is. The gradient travels the same way: the mix's gradient in its own dtype, bit for bit, in the same channels.
A reinterpreted channel is not a number of the streams' dtype: two gradients of the carrier must never be
added, so the carrier is read by one `unpack` that gives both parts (and built by one `pack`).
"""

from __future__ import annotations

import enum

import torch

from mhc_core.checks import check_rank, check_streams, shape_str

__all__ = ["HandoffPrecision", "handoff_channels", "pack", "unpack"]


class HandoffPrecision(enum.StrEnum):
    """How the mix crosses a pipeline stage boundary."""

    EXACT = "exact"
    """In its own dtype (an fp32 mix as its bytes behind bf16 streams): the pipelined run is the single process's
    arithmetic (the suite's rule)."""
    PIPELINE_DTYPE = "pipeline_dtype"
    """Rounded to the pipeline's dtype (bf16) at every stage boundary, forward and backward, in n channels: upstream
    `DSv41HybridStack`'s packing. Kept to measure what it costs (`docs/pipeline.md`)."""


def handoff_channels(n: int, streams_dtype: torch.dtype, mix_dtype: torch.dtype) -> int:
    """k, the channels of `streams_dtype` the mix `[s, b, n]` of `mix_dtype` takes in the carrier: n when the mix
    is no wider than the streams (it is then cast to them: the caller's choice), else `n * itemsize(mix) /
    itemsize(streams)`."""
    n = check_streams(n, op="handoff_channels")
    wide, narrow = (
        torch.empty(0, dtype=mix_dtype).element_size(),
        torch.empty(0, dtype=streams_dtype).element_size(),
    )
    if wide <= narrow:
        return n
    if wide % narrow:
        raise ValueError(f"handoff_channels: a {mix_dtype} mix does not fill whole {streams_dtype} channels")
    return n * wide // narrow


def _as_channels(mix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[s, b, n]` of the mix's dtype as `[s, b, k]` channels of `dtype`: reinterpreted when wider, else cast."""
    if mix.element_size() > torch.empty(0, dtype=dtype).element_size():
        return mix.contiguous().view(dtype)
    return mix.to(dtype)


def _from_channels(tail: torch.Tensor, mix_dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `_as_channels`."""
    if torch.empty(0, dtype=mix_dtype).element_size() > tail.element_size():
        return tail.contiguous().view(mix_dtype)
    return tail.to(mix_dtype)


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        ctx.width, ctx.mix_dtype = streams.shape[-1], mix.dtype
        return torch.cat([streams, _as_channels(mix, streams.dtype)], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., : ctx.width], _from_channels(grad[..., ctx.width :], ctx.mix_dtype)


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier: torch.Tensor, width: int, mix_dtype: torch.dtype):
        ctx.dtype = carrier.dtype
        return carrier[..., :width], _from_channels(carrier[..., width:], mix_dtype)

    @staticmethod
    def backward(ctx, grad_streams: torch.Tensor, grad_mix: torch.Tensor):  # materialized: zeros where unused
        return torch.cat([grad_streams.to(ctx.dtype), _as_channels(grad_mix, ctx.dtype)], dim=-1), None, None


def pack(streams: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """`streams [s, b, n*C]` and `mix [s, b, n]` -> the carrier `[s, b, n*C + k]` in the streams' dtype
    (differentiable in both; the mix's gradient comes back in its own dtype)."""
    op = "handoff.pack"
    check_rank(streams, 3, name="streams", op=op, layout="[s, b, n*C]")
    check_rank(mix, 3, name="mix", op=op, layout="[s, b, n]")
    if mix.shape[:2] != streams.shape[:2]:
        raise ValueError(f"{op}: mix {shape_str(mix)} and streams {shape_str(streams)} differ in [s, b]")
    if not mix.is_floating_point() or not streams.is_floating_point():
        raise ValueError(
            f"{op}: streams and mix must be floating tensors, got {streams.dtype} and {mix.dtype}"
        )
    return _Pack.apply(streams, mix)


def unpack(carrier: torch.Tensor, n: int, mix_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The carrier `[s, b, n*C + k]` -> `(streams [s, b, n*C], a view of the carrier; mix [s, b, n] in
    `mix_dtype`)`. `ValueError` naming the carrier when its width is not `n*C + k` for any C."""
    op = "handoff.unpack"
    n = check_streams(n, op=op)
    check_rank(carrier, 3, name="carrier", op=op, layout="[s, b, n*C + k]")
    k = handoff_channels(n, carrier.dtype, mix_dtype)
    width = carrier.shape[-1] - k
    if width <= 0 or width % n:
        raise ValueError(
            f"{op}: carrier {shape_str(carrier)} ({carrier.dtype}) is not [s, b, n*C + k] with n = {n} "
            f"and k = {k} channels of a {mix_dtype} mix"
        )
    return _Unpack.apply(carrier, width, mix_dtype)
