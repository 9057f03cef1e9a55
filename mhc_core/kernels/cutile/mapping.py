"""cuTile `mapping` and the fused pre-op's mapping part: autograd functions and wrappers.

`x[T, n*C] -> h_pre[T, n], h_post[T, n], h_res_logits[T, n, n]`. Forward: split-K partial
projection, then the epilogue (RMS, gates); backward: the coefficient gradients, then dx / dW.

`pre` (`mhc_core.ops.pre`): the same two launches each way with the aggregate in them: the epilogue also
sums the block's streams weighted by h_pre (`pre_fwd_epilogue_kernel`), the coefficient kernel adds the
aggregate's gradient of h_pre (`pre_bwd_coef_kernel`), and the dx kernel adds `h_pre (x) grad_agg` to the one
gradient of x it writes (`pre_bwd_dx_dw_kernel`); Sinkhorn runs as its own op on the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.constants import MMA_3XTF32, MMA_BF16, MMA_TF32
from mhc_core.kernels.cutile.runtime import cdiv, require_device, require_dtypes, require_n
from mhc_core.ops.mapping import NORM_EPS, check_mapping_args, num_mapping_outputs
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = ["mapping", "mma_mode", "pre", "pre_tile_c"]


def mma_mode(x_dtype: torch.dtype, spec: VariantSpec) -> int:
    """Tensor-core precision of the mapping projection for activations of `x_dtype`.

    Forward: bf16 operands where the reference itself rounds the weight to bf16 (`megatron_main`
    with bf16 activations); TF32 for bf16 activations of the fp32 variants (bf16 is exact in TF32, the
    weight is rounded to TF32); for fp32 activations 3xTF32 (about fp32 accuracy), or plain TF32
    when `torch.backends.cuda.matmul.allow_tf32` allows it for torch's own fp32 matmuls.
    The backward uses `max(mode, TF32)`.
    """
    if x_dtype == torch.bfloat16:
        return MMA_TF32 if spec.mapping_fp32 else MMA_BF16
    return MMA_TF32 if torch.backends.cuda.matmul.allow_tf32 else MMA_3XTF32



def _forward(rt: Any, x, weight, alphas, bias, n: int, out_dtype: torch.dtype, mma: int, h_pre_eps: float,
             norm_eps: float, eps_inside: float, tile_c: int | None = None):
    """The forward launches: `(h_pre, h_post, h_res_logits, proj_pp, proj_res, rms, aggregate or None)`; with
    `tile_c` the second launch is the fused pre-op's, which also aggregates the streams."""
    t, k = x.shape
    dev = x.device
    f32 = torch.float32
    tl = tiling.mapping_tiles(n, k, "fwd")
    m_blocks, k_tiles = cdiv(t, tl.tile_m), cdiv(k, tl.tile_k)
    splits = tiling.split_count(m_blocks, k_tiles, rt.num_sms(dev))
    per_split = cdiv(k_tiles, splits)
    splits = cdiv(k_tiles, per_split)  # no empty split
    part_pp = torch.empty((splits, t, 2 * n), dtype=f32, device=dev)
    part_res = torch.empty((splits, t, n * n), dtype=f32, device=dev)
    part_sq = torch.empty((splits, t), dtype=f32, device=dev)
    h_pre = torch.empty((t, n), dtype=out_dtype, device=dev)
    h_post = torch.empty((t, n), dtype=out_dtype, device=dev)
    h_res = torch.empty((t, n, n), dtype=out_dtype, device=dev)
    proj_pp = torch.empty((t, 2 * n), dtype=f32, device=dev)
    proj_res = torch.empty((t, n * n), dtype=f32, device=dev)
    rms = torch.empty((t,), dtype=f32, device=dev)
    agg = None if tile_c is None else torch.empty((t, k // n), dtype=x.dtype, device=dev)
    if t:
        rt.launch(
            (m_blocks, splits),
            "mapping_fwd_partial_kernel",
            (x, weight[: 2 * n], weight[2 * n :], part_pp, part_res, part_sq, per_split, n, tl.tile_m, tl.tile_k, mma),
        )
        head = (part_pp, part_res, part_sq, *alphas, bias[: 2 * n], bias[2 * n :])
        tail = (proj_pp, proj_res, rms)
        scalars = (1.0 / k, float(norm_eps), float(h_pre_eps), float(eps_inside), n, tl.tile_m)
        if tile_c is None:
            rt.launch((m_blocks,), "mapping_fwd_epilogue_kernel", (*head, h_pre, h_post, h_res, *tail, *scalars))
        else:
            rt.launch((m_blocks,), "pre_fwd_epilogue_kernel",
                      (*head, x, h_pre, h_post, h_res, *tail, agg, *scalars, tile_c))
    return h_pre, h_post, h_res, proj_pp, proj_res, rms, agg


def _backward(rt: Any, saved, grads, n: int, mma: int, norm_eps: float, agg=None):
    """The backward launches: `(grad_x, grad_w, grad_alpha_pre, _post, _res, grad_bias)`. With `agg =
    (grad_agg, h_pre, tile_c)` they are the fused pre-op's: h_pre's gradient gains the aggregate's and `grad_x`
    its `h_pre (x) grad_agg`."""
    x, weight, alpha_pre, alpha_post, alpha_res, bias, proj_pp, proj_res, rms = saved
    # gp is an fp32 intermediate: rounding it to bf16 would add error the reference math does
    # not have, so the backward MMAs use TF32 at least (x in bf16 is exact in TF32).
    mma = max(mma, MMA_TF32)
    t, k = x.shape
    dev = x.device
    f32 = torch.float32
    grads = tuple(g.contiguous() for g in grads)
    tl = tiling.mapping_tiles(n, k, "bwd")
    m_blocks, k_tiles = cdiv(t, tl.tile_m), cdiv(k, tl.tile_k)
    gp_pp = torch.empty((t, 2 * n), dtype=f32, device=dev)
    gp_res = torch.empty((t, n * n), dtype=f32, device=dev)
    cx = torch.empty((t,), dtype=f32, device=dev)
    # Every element of the partial buffers is written by the kernels when t > 0.
    alloc = torch.empty if t else torch.zeros
    gbias_pp = alloc((max(m_blocks, 1), 2 * n), dtype=f32, device=dev)
    gbias_res = alloc((max(m_blocks, 1), n * n), dtype=f32, device=dev)
    galpha = alloc((max(m_blocks, 1), 4), dtype=f32, device=dev)
    splits = tiling.split_count(k_tiles, m_blocks, rt.num_sms(dev)) if t else 1
    per_split = cdiv(m_blocks, splits) if t else 1
    splits = cdiv(m_blocks, per_split) if t else 1
    gw_part = alloc((splits, num_mapping_outputs(n), k), dtype=f32, device=dev)
    grad_x = torch.empty_like(x)
    if t:
        coef = (*grads, proj_pp, proj_res, rms, alpha_pre, alpha_post, alpha_res, bias[: 2 * n], bias[2 * n :],
                gp_pp, gp_res, cx, gbias_pp, gbias_res, galpha, 1.0 / k, norm_eps, n, tl.tile_m)
        w = (x, weight[: 2 * n], weight[2 * n :], gp_pp, gp_res, cx)
        out = (grad_x, gw_part[:, : 2 * n], gw_part[:, 2 * n :], per_split, n, tl.tile_m, tl.tile_k, mma)
        if agg is None:
            rt.launch((m_blocks,), "mapping_bwd_coef_kernel", coef)
            rt.launch((k_tiles, splits), "mapping_bwd_dx_dw_kernel", (*w, *out))
        else:
            grad_agg, h_pre, tile_c = agg
            rt.launch((m_blocks,), "pre_bwd_coef_kernel", (grad_agg.contiguous(), x, *coef, tile_c))
            rt.launch((k_tiles, splits), "pre_bwd_dx_dw_kernel",
                      (*w, grad_agg.contiguous(), h_pre.to(f32).contiguous(), *out))
    grad_w = (gw_part.sum(dim=0) if splits > 1 else gw_part[0]).to(weight.dtype)
    grad_bias = torch.cat((gbias_pp.sum(dim=0), gbias_res.sum(dim=0))).to(bias.dtype)
    ga = galpha.sum(dim=0)
    return (grad_x, grad_w, ga[0:1].to(alpha_pre.dtype), ga[1:2].to(alpha_post.dtype), ga[2:3].to(alpha_res.dtype),
            grad_bias)


class _MappingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, alpha_pre, alpha_post, alpha_res, bias, n: int, out_dtype: torch.dtype,
                mma: int, h_pre_eps: float, norm_eps: float, eps_inside: float, rt: Any):
        x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
        alphas = tuple(a.contiguous() for a in (alpha_pre, alpha_post, alpha_res))
        h_pre, h_post, h_res, proj_pp, proj_res, rms, _ = _forward(rt, x, weight, alphas, bias, n, out_dtype, mma,
                                                                   h_pre_eps, norm_eps, eps_inside)
        ctx.save_for_backward(x, weight, *alphas, bias, proj_pp, proj_res, rms)
        ctx.args = (n, mma, float(norm_eps), rt)
        return h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res):
        n, mma, norm_eps, rt = ctx.args
        grads = _backward(rt, ctx.saved_tensors, (grad_pre, grad_post, grad_res), n, mma, norm_eps)
        return (*grads, None, None, None, None, None, None, None)


class _PreFn(torch.autograd.Function):
    """The fused pre-op without Sinkhorn: `(aggregate, h_pre, h_post, h_res_logits)`, two launches each way."""

    @staticmethod
    def forward(ctx, x, weight, alpha_pre, alpha_post, alpha_res, bias, n: int, out_dtype: torch.dtype,
                mma: int, h_pre_eps: float, norm_eps: float, eps_inside: float, tile_c: tuple[int, int], rt: Any):
        x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
        alphas = tuple(a.contiguous() for a in (alpha_pre, alpha_post, alpha_res))
        h_pre, h_post, logits, proj_pp, proj_res, rms, agg = _forward(rt, x, weight, alphas, bias, n, out_dtype, mma,
                                                                      h_pre_eps, norm_eps, eps_inside, tile_c[0])
        ctx.save_for_backward(x, weight, *alphas, bias, proj_pp, proj_res, rms, h_pre)
        ctx.args = (n, mma, float(norm_eps), tile_c, rt)
        return agg, h_pre, h_post, logits

    @staticmethod
    def backward(ctx, grad_agg, grad_pre, grad_post, grad_res):
        # Autograd materialises the gradient of an unused output as zeros (the default).
        n, mma, norm_eps, tile_c, rt = ctx.args
        *saved, h_pre = ctx.saved_tensors
        grads = _backward(rt, saved, (grad_pre, grad_post, grad_res), n, mma, norm_eps,
                          agg=(grad_agg, h_pre, tile_c[1]))
        return (*grads, None, None, None, None, None, None, None, None)


PRE_TILE_ELEMENTS = 4096
"""The most elements of a `[TILE_M, TILE_C]` tile of the fused pre-op's aggregate loops: the forward
epilogue at 64 x 256 needs all 255 registers and spills, at 64 x 64 none; the backward coefficient kernel
at 32 x 256 takes 219 KB of shared memory, at 32 x 128 139 KB (sm_90, `docs/measurements/`)."""


def pre_tile_c(n: int, k: int, direction: str) -> int | None:
    """The channel tile of the fused pre-op's aggregate loop in `direction` (`fwd`: the epilogue kernel; `bwd`:
    the coefficient kernel) at `K = n*C`: the largest power of two dividing C, at most 256 and
    `PRE_TILE_ELEMENTS / TILE_M`; None where the backward's K tiles would cross a stream boundary
    (`tiling.mapping_tiles` bwd `tile_k` must divide C): the pre-op then runs as its three ops."""
    c = k // n
    if c % tiling.mapping_tiles(n, k, "bwd").tile_k:
        return None
    tile = min(256, max(1, PRE_TILE_ELEMENTS // tiling.mapping_tiles(n, k, direction).tile_m))
    while c % tile:
        tile //= 2
    return tile


def mapping(
    rt: Callable[[], Any],
    x,
    weight,
    alpha_pre,
    alpha_post,
    alpha_res,
    bias,
    n,
    variant=Variant.MEGATRON_MAIN,
    norm_eps=NORM_EPS,
):
    """`mhc_core.ops.mapping` on the runtime `rt()`.

    `x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`.
    """
    op = "mapping"
    spec = get_variant(variant)
    n = check_mapping_args(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, op=op, norm_eps=norm_eps)
    require_n(n, op)
    tensors = dict(x=x, weight=weight, alpha_pre=alpha_pre, alpha_post=alpha_post, alpha_res=alpha_res, bias=bias)
    require_dtypes(op, **tensors)
    runtime = rt()
    require_device(runtime, op, **tensors)
    compute = torch.float32 if spec.mapping_fp32 else x.dtype
    out_dtype = x.dtype if spec.coefficients_in_activation_dtype else compute
    inside = spec.norm_eps_inside
    return _MappingFn.apply(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, out_dtype, mma_mode(x.dtype, spec),
        float(spec.h_pre_eps), 0.0 if inside else float(norm_eps), float(norm_eps) if inside else 0.0, runtime,
    )


def pre(rt: Callable[[], Any], x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations=20,
        variant=Variant.MEGATRON_MAIN, norm_eps=NORM_EPS, sinkhorn=None):
    """`mhc_core.ops.pre` on the runtime `rt()`: `x [T, n*C] -> aggregate [T, C], h_pre, h_post [T, n],
    h_res [T, n, n]` (`sinkhorn`: the cuTile Sinkhorn op, applied to the logits). `None` where the formulation
    in force is the composition (`tiling.pre_tiles`) or the fused launches do not cover the shape
    (`pre_tile_c`): the caller runs the three ops."""
    spec = get_variant(variant)
    k = x.shape[1]
    if not tiling.pre_tiles(n).fused:
        return None
    tile_c = (pre_tile_c(n, k, "fwd"), pre_tile_c(n, k, "bwd"))
    if None in tile_c:
        return None
    op = "pre"
    tensors = dict(x=x, weight=weight, alpha_pre=alpha_pre, alpha_post=alpha_post, alpha_res=alpha_res, bias=bias)
    require_n(n, op)
    require_dtypes(op, **tensors)
    runtime = rt()
    require_device(runtime, op, **tensors)
    compute = torch.float32 if spec.mapping_fp32 else x.dtype
    out_dtype = x.dtype if spec.coefficients_in_activation_dtype else compute
    inside = spec.norm_eps_inside
    agg, h_pre, h_post, logits = _PreFn.apply(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, out_dtype, mma_mode(x.dtype, spec),
        float(spec.h_pre_eps), 0.0 if inside else float(norm_eps), float(norm_eps) if inside else 0.0, tile_c, runtime,
    )
    return agg, h_pre, h_post, sinkhorn(logits, iterations, None, spec)
