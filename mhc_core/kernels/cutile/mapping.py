"""cuTile `mapping` and the fused pre-op's mapping part: autograd functions and wrappers.

`x[T, n*C] -> h_pre[T, n], h_post[T, n], h_res_logits[T, n, n]`. Forward: split-K partial
projection, then the epilogue (RMS, gates); backward: the coefficient gradients, then dx / dW.

`pre` (`mhc_core.ops.pre`) fused, `tiling.PreTiles(fused=True)`: forward, the mapping's two launches and the
aggregate's (h_pre needs the whole split-K reduction, so the aggregate reads x again whatever the fusion);
backward, the aggregate's gradient of h_pre alone (`h_aggregate_bwd_h_kernel`, fp32), added to h_pre's before
the coefficient kernel, and `pre_bwd_dx_dw_kernel`, which adds `h_pre (x) grad_agg` to the one gradient of x
it writes: no second gradient of x and no sum of two. Sinkhorn runs as its own op on the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.constants import MMA_3XTF32, MMA_BF16, MMA_TF32
from mhc_core.kernels.cutile.runtime import cdiv, require_device, require_dtypes, require_n
from mhc_core.kernels.cutile.streams import aggregate_forward, aggregate_grad_h
from mhc_core.ops.mapping import MappingCall, effective_norm_eps, num_mapping_outputs
from mhc_core.ops.pre import PreCall
from mhc_core.variants import VariantSpec

__all__ = ["mapping", "mma_mode", "pre", "pre_fuses"]


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


def _forward(
    rt: Any,
    x,
    weight,
    alphas,
    bias,
    n: int,
    out_dtype: torch.dtype,
    mma: int,
    h_pre_eps: float,
    norm_eps: float,
    eps_inside: float,
):
    """The forward launches: `(h_pre, h_post, h_res_logits, proj_pp, proj_res, rms)`."""
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
    if t:
        rt.launch(
            (m_blocks, splits),
            "mapping_fwd_partial_kernel",
            (
                x,
                weight[: 2 * n],
                weight[2 * n :],
                part_pp,
                part_res,
                part_sq,
                per_split,
                n,
                tl.tile_m,
                tl.tile_k,
                mma,
            ),
        )
        head = (part_pp, part_res, part_sq, *alphas, bias[: 2 * n], bias[2 * n :])
        tail = (proj_pp, proj_res, rms)
        scalars = (1.0 / k, float(norm_eps), float(h_pre_eps), float(eps_inside), n, tl.tile_m)
        rt.launch((m_blocks,), "mapping_fwd_epilogue_kernel", (*head, h_pre, h_post, h_res, *tail, *scalars))
    return h_pre, h_post, h_res, proj_pp, proj_res, rms


def _backward(rt: Any, saved, grads, n: int, mma: int, norm_eps: float, agg=None):
    """The backward launches: `(grad_x, grad_w, grad_alpha_pre, _post, _res, grad_bias)`. With `agg =
    (grad_agg, h_pre)` they are the fused pre-op's: h_pre's gradient gains the aggregate's (fp32) and `grad_x`
    its `h_pre (x) grad_agg`."""
    x, weight, alpha_pre, alpha_post, alpha_res, bias, proj_pp, proj_res, rms = saved
    # gp is an fp32 intermediate: rounding it to bf16 would add error the reference math does
    # not have, so the backward MMAs use TF32 at least (x in bf16 is exact in TF32).
    mma = max(mma, MMA_TF32)
    t, k = x.shape
    dev = x.device
    f32 = torch.float32
    if agg is not None and t:
        grad_agg = agg[0].to(x.dtype).contiguous()
        gh = aggregate_grad_h(rt, x.view(t, n, k // n), grad_agg)
        grads = (grads[0].float() + gh, *grads[1:])
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
        coef = (
            *grads,
            proj_pp,
            proj_res,
            rms,
            alpha_pre,
            alpha_post,
            alpha_res,
            bias[: 2 * n],
            bias[2 * n :],
            gp_pp,
            gp_res,
            cx,
            gbias_pp,
            gbias_res,
            galpha,
            1.0 / k,
            norm_eps,
            n,
            tl.tile_m,
        )
        w = (x, weight[: 2 * n], weight[2 * n :], gp_pp, gp_res, cx)
        out = (grad_x, gw_part[:, : 2 * n], gw_part[:, 2 * n :], per_split, n, tl.tile_m, tl.tile_k, mma)
        rt.launch((m_blocks,), "mapping_bwd_coef_kernel", coef)
        if agg is None:
            rt.launch((k_tiles, splits), "mapping_bwd_dx_dw_kernel", (*w, *out))
        else:
            rt.launch(
                (k_tiles, splits), "pre_bwd_dx_dw_kernel", (*w, grad_agg, agg[1].to(f32).contiguous(), *out)
            )
    grad_w = (gw_part.sum(dim=0) if splits > 1 else gw_part[0]).to(weight.dtype)
    grad_bias = torch.cat((gbias_pp.sum(dim=0), gbias_res.sum(dim=0))).to(bias.dtype)
    ga = galpha.sum(dim=0)
    return (
        grad_x,
        grad_w,
        ga[0:1].to(alpha_pre.dtype),
        ga[1:2].to(alpha_post.dtype),
        ga[2:3].to(alpha_res.dtype),
        grad_bias,
    )


def _forward_saving(
    ctx,
    rt: Any,
    x,
    weight,
    alphas,
    bias,
    n: int,
    out_dtype: torch.dtype,
    mma: int,
    h_pre_eps: float,
    norm_eps: float,
    eps_inside: float,
):
    """`_forward` on contiguous inputs, with `ctx.args` set for `_backward`: `(x, saved, h_pre, h_post,
    h_res_logits)`, `saved` the tensors `_backward` reads (for `ctx.save_for_backward`)."""
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    alphas = tuple(a.contiguous() for a in alphas)
    h_pre, h_post, h_res, proj_pp, proj_res, rms = _forward(
        rt, x, weight, alphas, bias, n, out_dtype, mma, h_pre_eps, norm_eps, eps_inside
    )
    ctx.args = (n, mma, float(norm_eps), rt)
    return x, (x, weight, *alphas, bias, proj_pp, proj_res, rms), h_pre, h_post, h_res


class _MappingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        alpha_pre,
        alpha_post,
        alpha_res,
        bias,
        n: int,
        out_dtype: torch.dtype,
        mma: int,
        h_pre_eps: float,
        norm_eps: float,
        eps_inside: float,
        rt: Any,
    ):
        _, saved, h_pre, h_post, h_res = _forward_saving(
            ctx,
            rt,
            x,
            weight,
            (alpha_pre, alpha_post, alpha_res),
            bias,
            n,
            out_dtype,
            mma,
            h_pre_eps,
            norm_eps,
            eps_inside,
        )
        ctx.save_for_backward(*saved)
        return h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res):
        n, mma, norm_eps, rt = ctx.args
        grads = _backward(rt, ctx.saved_tensors, (grad_pre, grad_post, grad_res), n, mma, norm_eps)
        return (*grads, None, None, None, None, None, None, None)


class _PreFn(torch.autograd.Function):
    """The fused pre-op without Sinkhorn: `(aggregate, h_pre, h_post, h_res_logits)`, three launches each way."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        alpha_pre,
        alpha_post,
        alpha_res,
        bias,
        n: int,
        out_dtype: torch.dtype,
        mma: int,
        h_pre_eps: float,
        norm_eps: float,
        eps_inside: float,
        rt: Any,
    ):
        x, saved, h_pre, h_post, logits = _forward_saving(
            ctx,
            rt,
            x,
            weight,
            (alpha_pre, alpha_post, alpha_res),
            bias,
            n,
            out_dtype,
            mma,
            h_pre_eps,
            norm_eps,
            eps_inside,
        )
        t, k = x.shape
        agg = aggregate_forward(rt, x.view(t, n, k // n), h_pre)
        ctx.save_for_backward(*saved, h_pre)
        return agg, h_pre, h_post, logits

    @staticmethod
    def backward(ctx, grad_agg, grad_pre, grad_post, grad_res):
        # Autograd materialises the gradient of an unused output as zeros (the default).
        n, mma, norm_eps, rt = ctx.args
        *saved, h_pre = ctx.saved_tensors
        grads = _backward(rt, saved, (grad_pre, grad_post, grad_res), n, mma, norm_eps, agg=(grad_agg, h_pre))
        return (*grads, None, None, None, None, None, None, None)


def pre_fuses(n: int, k: int) -> bool:
    """Whether the fused pre-op's launches cover `K = n*C`: the backward's K tile (`tiling.mapping_tiles`)
    divides C, so that each tile of `pre_bwd_dx_dw_kernel` lies in one stream; elsewhere the three ops run."""
    return (k // n) % tiling.mapping_tiles(n, k, "bwd").tile_k == 0


def mapping(rt: Callable[[], Any], call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mhc_core.ops.mapping` of a checked call on the runtime `rt()`.

    `x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`.
    """
    args = (call.x, *call.params)
    return _MappingFn.apply(
        *args, call.n, *_launch_settings(rt, "mapping", args, call.n, call.spec, call.norm_eps)
    )


def _launch_settings(
    rt: Callable[[], Any], op: str, args: tuple, n: int, spec: VariantSpec, norm_eps: float
) -> tuple:
    """The checks of the runtime and the settings after `n` of `_MappingFn` / `_PreFn` for `args = (x, weight,
    alpha_pre, alpha_post, alpha_res, bias)`: `(out_dtype, mma, h_pre_eps, norm_eps, eps_inside, runtime)`, the
    spec's eps placement giving `norm_eps` to one of the two eps and 0 to the other."""
    require_n(n, op)
    tensors = dict(zip(("x", "weight", "alpha_pre", "alpha_post", "alpha_res", "bias"), args, strict=True))
    require_dtypes(op, **tensors)
    runtime = rt()
    require_device(runtime, op, **tensors)
    x = args[0]
    compute = torch.float32 if spec.mapping_fp32 else x.dtype
    norm_eps = effective_norm_eps(spec, norm_eps, compute)
    out_dtype = x.dtype if spec.coefficients_in_activation_dtype else compute
    inside = spec.norm_eps_inside
    return (
        out_dtype,
        mma_mode(x.dtype, spec),
        float(spec.h_pre_eps),
        0.0 if inside else float(norm_eps),
        float(norm_eps) if inside else 0.0,
        runtime,
    )


def pre(
    rt: Callable[[], Any], call: PreCall, sinkhorn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`mhc_core.ops.pre` of a checked call on the runtime `rt()`: `x [T, n*C] -> aggregate [T, C], h_pre,
    h_post [T, n], h_res [T, n, n]` (`sinkhorn`: the cuTile Sinkhorn of the logits `[T, n, n]`). `None` where the
    formulation in force is the composition (`tiling.pre_tiles`) or the fused launches do not cover the shape
    (`pre_fuses`): the caller runs the three ops."""
    n, k = call.n, call.x.shape[1]
    if not (tiling.pre_tiles(n).fused and pre_fuses(n, k)):
        return None
    args = (call.x, *call.params)
    agg, h_pre, h_post, logits = _PreFn.apply(
        *args, n, *_launch_settings(rt, "pre", args, n, call.spec, call.norm_eps)
    )
    return agg, h_pre, h_post, sinkhorn(logits)
