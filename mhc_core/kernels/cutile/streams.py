"""cuTile `h_aggregate` and `h_post_bda`, the ops on the `n` streams: autograd functions and wrappers
launching the `stream_kernels` kernels.

    h_aggregate  x[T, n, C], h_pre[T, n] -> [T, C]
    h_post_bda   h_res[T, n, n], residual[T, n, C], h_post[T, n], y[T, C], bias[C] | None -> [T, n, C]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.constants import MMA_2XBF16, MMA_3XTF32, MMA_BF16, MMA_TF32
from mhc_core.kernels.cutile.runtime import (
    cdiv,
    require_device,
    require_dtypes,
    require_n,
    require_no_training_dropout,
)
from mhc_core.ops.aggregate import AggregateCall
from mhc_core.ops.post_bda import PostBdaCall

__all__ = ["aggregate_forward", "aggregate_grad_h", "h_aggregate", "h_post_bda"]


def _fwd_grid(t: int, c: int, tl: tiling.StreamTiles) -> tuple[int, ...]:
    """Token tiles x channel tiles, or token tiles only when each block walks C (`loop_c`)."""
    return (cdiv(t, tl.tile_t),) if tl.loop_c else (cdiv(t, tl.tile_t), cdiv(c, tl.tile_c))


def aggregate_forward(rt: Any, x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """The h_aggregate forward launch on contiguous `x [T, n, C]`, `h_pre [T, n]`: `[T, C]` in x's dtype."""
    t, n, c = x.shape
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    tl = tiling.aggregate_tiles(n, c, "fwd")
    if t and c:
        rt.launch(
            _fwd_grid(t, c, tl),
            "h_aggregate_fwd_kernel",
            (
                x,
                h_pre,
                out,
                n,
                tl.tile_t,
                tl.tile_c,
                int(tl.loop_c),
                *_tensor_cores(
                    tl.mma, tl.tile_t * n, (tl.tile_c, tl.tile_t), x.dtype, h_pre.dtype == torch.bfloat16
                ),
            ),
        )
    return out


def aggregate_grad_h(rt: Any, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The aggregate's gradient of h_pre alone, `[T, n]` fp32, from contiguous `x [T, n, C]` and
    `grad_out [T, C]` (in x's dtype): `h_aggregate_bwd_h_kernel` under the h_aggregate backward's tiles."""
    t, n, c = x.shape
    grad_h = torch.empty((t, n), dtype=torch.float32, device=x.device)
    tl = tiling.aggregate_tiles(n, c, "bwd")
    if t and c:
        rt.launch(
            (cdiv(t, tl.tile_t),), "h_aggregate_bwd_h_kernel", (grad_out, x, grad_h, n, tl.tile_t, tl.tile_c)
        )
    else:
        grad_h.zero_()
    return grad_h


class _AggregateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, h_pre: torch.Tensor, rt: Any):
        x, h_pre = x.contiguous(), h_pre.contiguous()
        out = aggregate_forward(rt, x, h_pre)
        ctx.save_for_backward(x, h_pre)
        ctx.rt = rt
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, h_pre = ctx.saved_tensors
        t, n, c = x.shape
        go = grad_out.to(x.dtype).contiguous()
        grad_x = torch.empty_like(x)
        grad_h = torch.empty_like(h_pre)
        tl = tiling.aggregate_tiles(n, c, "bwd")
        if t and c:
            ctx.rt.launch(
                (cdiv(t, tl.tile_t),),
                "h_aggregate_bwd_kernel",
                (go, x, h_pre, grad_x, grad_h, n, tl.tile_t, tl.tile_c),
            )
        else:
            grad_h.zero_()
        return grad_x, grad_h, None


def h_aggregate(rt: Callable[[], Any], call: AggregateCall) -> torch.Tensor:
    """`mhc_core.ops.h_aggregate` of a checked call on the runtime `rt()`: `x [T, n, C], h_pre [T, n] -> [T, C]`."""
    op, x, h_pre = "h_aggregate", call.x, call.h_pre
    require_n(x.shape[1], op)
    require_dtypes(op, x=x, h_pre=h_pre)
    runtime = rt()
    require_device(runtime, op, x=x, h_pre=h_pre)
    return _AggregateFn.apply(x, h_pre, runtime)


MMA_MIN_K, MMA_MIN_MN = 16, 8
"""The smallest tensor-core shape the MMA formulation feeds (bf16 m16n8k16): a reduction (K) of at
least 16 and output edges of at least 8; smaller tiles keep the CUDA-core formulation (sm_90 gave
wrong products for a K = 4 MMA in the mapping backward)."""


def _tensor_cores(
    use: bool, k: int, mn: tuple[int, ...], act: torch.dtype, right_exact: bool
) -> tuple[int, int]:
    """The `TENSOR_CORES, MMA` constants of the `h_aggregate` forward: `(0, MMA_BF16)` (CUDA cores; `MMA`
    unused) unless `use` and the tile's MMA has `k >= 16` and every edge in `mn` >= 8; else `(1, MMA)`
    with bf16 products for bf16 activations when the right operand is exact in bf16 (bf16
    coefficients), bf16 hi + lo of it when it is fp32 (2xBF16), and for fp32 activations TF32 when
    torch's own fp32 matmuls may use it, else 3xTF32."""
    if not use or k < MMA_MIN_K or min(mn) < MMA_MIN_MN:
        return 0, MMA_BF16
    if act == torch.bfloat16:
        return 1, MMA_BF16 if right_exact else MMA_2XBF16
    return 1, MMA_TF32 if torch.backends.cuda.matmul.allow_tf32 else MMA_3XTF32


class _PostBdaFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, residual, h_post, y, bias, transposed: bool, rt: Any):
        h_res, residual, h_post, y = (a.contiguous() for a in (h_res, residual, h_post, y))
        has_bias = bias is not None
        bias_arg = bias.contiguous() if has_bias else y.new_empty(1)  # never read when HAS_BIAS=0
        t, n, c = residual.shape
        out = torch.empty_like(residual)
        tl = tiling.post_bda_tiles(n, c, "fwd")
        if t and c:
            rt.launch(
                _fwd_grid(t, c, tl),
                "h_post_bda_fwd_kernel",
                (
                    h_res,
                    residual,
                    h_post,
                    y,
                    bias_arg,
                    out,
                    n,
                    tl.tile_t,
                    tl.tile_c,
                    int(transposed),
                    int(has_bias),
                    int(tl.loop_c),
                    int(tl.per_stream == tiling.StreamLayout.TUPLE),
                ),
            )
        ctx.save_for_backward(h_res, residual, h_post, y, bias_arg)
        ctx.args = (has_bias, transposed, rt)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h_res, residual, h_post, y, bias_arg = ctx.saved_tensors
        has_bias, transposed, rt = ctx.args
        t, n, c = residual.shape
        go = grad_out.to(residual.dtype).contiguous()
        grad_h_res = torch.empty_like(h_res)
        grad_residual = torch.empty_like(residual)
        grad_h_post = torch.empty_like(h_post)
        grad_y = torch.empty_like(y)
        tl = tiling.post_bda_tiles(n, c, "bwd")
        blocks = cdiv(t, tl.tile_t)
        part_shape = (blocks, c) if has_bias else (1, 1)
        bias_part = torch.empty(part_shape, dtype=torch.float32, device=residual.device)
        if t and c:
            rt.launch(
                (blocks,),
                "h_post_bda_bwd_kernel",
                (
                    go,
                    h_res,
                    residual,
                    h_post,
                    y,
                    bias_arg,
                    grad_h_res,
                    grad_residual,
                    grad_h_post,
                    grad_y,
                    bias_part,
                    n,
                    tl.tile_t,
                    tl.tile_c,
                    int(transposed),
                    int(has_bias),
                    int(tl.per_stream == tiling.StreamLayout.TUPLE),
                ),
            )
        else:
            grad_h_res.zero_()
            grad_h_post.zero_()
            bias_part.zero_()
        grad_bias = bias_part.sum(dim=0).to(bias_arg.dtype) if has_bias else None
        return grad_h_res, grad_residual, grad_h_post, grad_y, grad_bias, None, None


def h_post_bda(rt: Callable[[], Any], call: PostBdaCall) -> torch.Tensor:
    """`mhc_core.ops.h_post_bda` of a checked call on the runtime `rt()`: `-> [T, n, C]` (no dropout in training)."""
    op = "h_post_bda"
    h_res, residual, h_post, y, bias = call.h_res, call.residual, call.h_post, call.y, call.bias
    require_no_training_dropout(op, call.dropout_p, call.training)
    require_n(residual.shape[1], op)
    require_dtypes(op, h_res=h_res, residual=residual, h_post=h_post, y=y, bias=bias)
    runtime = rt()
    require_device(runtime, op, h_res=h_res, residual=residual, h_post=h_post, y=y, bias=bias)
    return _PostBdaFn.apply(h_res, residual, h_post, y, bias, call.spec.res_transposed, runtime)
