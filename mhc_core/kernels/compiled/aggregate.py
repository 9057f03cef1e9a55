"""`h_aggregate` for the compiled backend: one streaming pass forward, one fused pass backward.

    forward   out[t, c]  = sum_i h[t, i] * x[t, i, c]                 [T, n, C] x [T, n] -> [T, C]
    backward  g_x[t,i,c] = h[t, i] * g[t, c]                          [T, n, C]
              g_h[t, i]  = sum_c g[t, c] * x[t, i, c]                 [T, n]

Products and sums in fp32 (fp64 stays fp64), as the reference; the stream sum is unrolled over
the static `n`, so the forward is a single pointwise kernel over `[T, C]`.
"""

from __future__ import annotations

import torch

from mhc_core.kernels.compiled.common import acc_dtype, compile_for, mark_dynamic
from mhc_core.ops.aggregate import AggregateCall, h_aggregate_reference

__all__ = ["h_aggregate"]


def _fwd(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    acc = acc_dtype(x.dtype, h.dtype)
    hf = h.to(acc)
    out = hf[:, 0:1] * x[:, 0].to(acc)
    for i in range(1, x.shape[1]):
        out = out + hf[:, i : i + 1] * x[:, i].to(acc)
    return out.to(x.dtype)


def _bwd(g: torch.Tensor, x: torch.Tensor, h: torch.Tensor, need_x: bool, need_h: bool):
    acc = acc_dtype(x.dtype, h.dtype)
    gf = g.to(acc)
    g_x = (h.to(acc)[:, :, None] * gf[:, None, :]).to(x.dtype) if need_x else None
    g_h = (gf[:, None, :] * x.to(acc)).sum(-1).to(h.dtype) if need_h else None
    return g_x, g_h


class _HAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, h)
        key = (x.dtype, h.dtype, x.shape[1], x.device.type)
        return compile_for(_fwd, key)(mark_dynamic(x, 0), mark_dynamic(h, 0))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, h = ctx.saved_tensors
        need_x, need_h = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        key = (x.dtype, h.dtype, g.dtype, x.shape[1], x.device.type, need_x, need_h)
        g, x, h = (mark_dynamic(t, 0) for t in (g.contiguous(), x, h))
        return compile_for(_bwd, key)(g, x, h, need_x, need_h)


def h_aggregate(call: AggregateCall) -> torch.Tensor:
    """Weighted sum of the `n` streams (compiled backend) of a checked call (`mhc_core.ops.h_aggregate`).

    Returns:
        `[T, C]` in `x.dtype`.
    """
    if call.x.numel() == 0:
        return h_aggregate_reference(call)
    return _HAggregate.apply(call.x.contiguous(), call.h_pre.contiguous())
