"""The four mHC ops on cuTile kernels: argument checks, launch wrappers, autograd functions.

Each op has its reference signature (`mhc_core.ops`) and is differentiable through a
`torch.autograd.Function` whose forward and backward are cuTile launches. Launches go through
a runtime (`runtime.py`): the GPU, the CPU emulator or the signature recorder.

Bad arguments raise the reference's `ValueError`s. Cases without a kernel raise
`NotImplementedError` naming the case: `n` outside `tiling.SUPPORTED_N`, dtypes other than
bf16 / fp32 (fp16, fp64), dropout > 0 in training, tensors not on a CUDA device. Unlike the
reference ops, the kernels do not check their inputs for NaN / inf (that check syncs the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.ops._checks import check_dim, check_rank, check_streams, shape_str
from mhc_core.ops.mapping import NORM_EPS, num_mapping_outputs
from mhc_core.ops.post_bda import check_h_post_bda_args
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = ["CuTileOps", "make_ops", "mma_mode", "VARIANT_CODE", "SUPPORTED_DTYPES"]

VARIANT_CODE = {Variant.PAPER: 0, Variant.MEGATRON_MAIN: 1, Variant.MEGATRON_DEV: 2}
"""The `VARIANT` constant of the Sinkhorn kernels."""

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)

MMA_BF16, MMA_TF32, MMA_3XTF32 = 0, 1, 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require_n(n: int, op: str) -> None:
    if n not in tiling.SUPPORTED_N:
        raise NotImplementedError(
            f"cutile {op}: n={n} residual streams has no kernel (supported: {tiling.SUPPORTED_N}, "
            "tile shapes must be powers of two)"
        )


def _require_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(
                f"cutile {op}: {name} has dtype {t.dtype}; the kernels support bfloat16 and float32"
            )


def _require_device(rt: Any, op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None:
            rt.check_tensor(t, name, op)


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


# ---------------------------------------------------------------------------------------------
# sinkhorn
# ---------------------------------------------------------------------------------------------


class _SinkhornFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int, eps: float, code: int, rt: Any):
        n = logits.shape[-1]
        z = logits.reshape(-1, n, n).contiguous()
        out = torch.empty_like(z)
        tile = tiling.sinkhorn_tile(n)
        if z.shape[0]:
            rt.launch((_cdiv(z.shape[0], tile),), "sinkhorn_fwd_kernel", (z, out, iterations, eps, n, tile, code))
        ctx.save_for_backward(logits)
        ctx.args = (iterations, eps, code, rt)
        return out.view(logits.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        iterations, eps, code, rt = ctx.args
        n = logits.shape[-1]
        z = logits.reshape(-1, n, n).contiguous()
        g = grad_out.to(logits.dtype).reshape(-1, n, n).contiguous()
        grad = torch.empty_like(z)
        tile = tiling.sinkhorn_tile(n)
        if z.shape[0]:
            rt.launch(
                (_cdiv(z.shape[0], tile),), "sinkhorn_bwd_kernel", (z, g, grad, iterations, eps, n, tile, code)
            )
        return grad.view(logits.shape), None, None, None, None


def _sinkhorn(rt: Callable[[], Any], logits, iterations=20, eps=None, variant=Variant.MEGATRON_MAIN):
    op = "sinkhorn"
    spec = get_variant(variant)
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        check_rank(logits, 2, name="logits", op=op, layout="[..., n, n]")
    if logits.shape[-1] != logits.shape[-2] or logits.shape[-1] < 1:
        raise ValueError(f"{op}: logits must have shape [..., n, n] with n >= 1, got {shape_str(logits)}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"{op}: iterations={iterations!r} must be an integer >= 1")
    eps = spec.sinkhorn_eps if eps is None else float(eps)
    if eps < 0:
        raise ValueError(f"{op}: eps={eps!r} must be >= 0")
    if not logits.is_floating_point():
        raise ValueError(f"{op}: logits must be a floating tensor, got dtype {logits.dtype}")
    _require_n(logits.shape[-1], op)
    _require_dtypes(op, logits=logits)
    runtime = rt()
    _require_device(runtime, op, logits=logits)
    return _SinkhornFn.apply(logits, iterations, eps, VARIANT_CODE[spec.variant], runtime)


# ---------------------------------------------------------------------------------------------
# h_aggregate
# ---------------------------------------------------------------------------------------------


class _AggregateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, h_pre: torch.Tensor, rt: Any):
        x, h_pre = x.contiguous(), h_pre.contiguous()
        t, n, c = x.shape
        out = torch.empty((t, c), dtype=x.dtype, device=x.device)
        tl = tiling.aggregate_tiles(n, c, "fwd")
        if t and c:
            rt.launch(
                (_cdiv(t, tl.tile_t), _cdiv(c, tl.tile_c)),
                "h_aggregate_fwd_kernel",
                (x, h_pre, out, n, tl.tile_t, tl.tile_c),
            )
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
                (_cdiv(t, tl.tile_t),),
                "h_aggregate_bwd_kernel",
                (go, x, h_pre, grad_x, grad_h, n, tl.tile_t, tl.tile_c),
            )
        else:
            grad_h.zero_()
        return grad_x, grad_h, None


def _h_aggregate(rt: Callable[[], Any], x, h_pre):
    op = "h_aggregate"
    check_rank(x, 3, name="x", op=op, layout="[T, n, C]")
    t, n, _ = x.shape
    check_dim(h_pre, (t, n), name="h_pre", op=op, layout="[T, n]")
    _require_n(n, op)
    _require_dtypes(op, x=x, h_pre=h_pre)
    runtime = rt()
    _require_device(runtime, op, x=x, h_pre=h_pre)
    return _AggregateFn.apply(x, h_pre, runtime)


# ---------------------------------------------------------------------------------------------
# h_post_bda
# ---------------------------------------------------------------------------------------------


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
                (_cdiv(t, tl.tile_t), _cdiv(c, tl.tile_c)),
                "h_post_bda_fwd_kernel",
                (h_res, residual, h_post, y, bias_arg, out, n, tl.tile_t, tl.tile_c, int(transposed), int(has_bias)),
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
        blocks = _cdiv(t, tl.tile_t)
        part_shape = (blocks, c) if has_bias else (1, 1)
        bias_part = torch.empty(part_shape, dtype=torch.float32, device=residual.device)
        if t and c:
            rt.launch(
                (blocks,),
                "h_post_bda_bwd_kernel",
                (go, h_res, residual, h_post, y, bias_arg, grad_h_res, grad_residual, grad_h_post, grad_y,
                 bias_part, n, tl.tile_t, tl.tile_c, int(transposed), int(has_bias)),
            )
        else:
            grad_h_res.zero_()
            grad_h_post.zero_()
            bias_part.zero_()
        grad_bias = bias_part.sum(dim=0).to(bias_arg.dtype) if has_bias else None
        return grad_h_res, grad_residual, grad_h_post, grad_y, grad_bias, None, None


def _h_post_bda(
    rt: Callable[[], Any],
    h_res,
    residual,
    h_post,
    y,
    bias,
    dropout_p=0.0,
    training=False,
    variant=Variant.MEGATRON_MAIN,
):
    op = "h_post_bda"
    spec = get_variant(variant)
    check_h_post_bda_args(h_res, residual, h_post, y, bias, dropout_p, op=op)
    t, n, c = residual.shape
    if training and dropout_p > 0:
        raise NotImplementedError(
            f"cutile {op}: dropout_p={dropout_p} in training has no kernel (the fused bias-dropout-add "
            "covers dropout_p == 0 or eval only)"
        )
    _require_n(n, op)
    _require_dtypes(op, h_res=h_res, residual=residual, h_post=h_post, y=y, bias=bias)
    runtime = rt()
    _require_device(runtime, op, h_res=h_res, residual=residual, h_post=h_post, y=y, bias=bias)
    return _PostBdaFn.apply(h_res, residual, h_post, y, bias, spec.res_transposed, runtime)


# ---------------------------------------------------------------------------------------------
# mapping
# ---------------------------------------------------------------------------------------------


class _MappingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, alpha_pre, alpha_post, alpha_res, bias, n: int, out_dtype: torch.dtype,
                mma: int, h_pre_eps: float, norm_eps: float, rt: Any):
        x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
        alphas = tuple(a.contiguous() for a in (alpha_pre, alpha_post, alpha_res))
        t, k = x.shape
        dev = x.device
        f32 = torch.float32
        tl = tiling.mapping_tiles(n, k)
        m_blocks, k_tiles = _cdiv(t, tl.tile_m), _cdiv(k, tl.tile_k)
        splits = tiling.split_count(m_blocks, k_tiles, rt.num_sms(dev))
        per_split = _cdiv(k_tiles, splits)
        splits = _cdiv(k_tiles, per_split)  # no empty split
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
                (x, weight[: 2 * n], weight[2 * n :], part_pp, part_res, part_sq, per_split,
                 n, tl.tile_m, tl.tile_k, mma),
            )
            rt.launch(
                (m_blocks,),
                "mapping_fwd_epilogue_kernel",
                (part_pp, part_res, part_sq, *alphas, bias[: 2 * n], bias[2 * n :], h_pre, h_post, h_res,
                 proj_pp, proj_res, rms, 1.0 / k, float(norm_eps), float(h_pre_eps), n, tl.tile_m),
            )
        ctx.save_for_backward(x, weight, *alphas, bias, proj_pp, proj_res, rms)
        ctx.args = (n, mma, float(norm_eps), rt)
        return h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res):
        x, weight, alpha_pre, alpha_post, alpha_res, bias, proj_pp, proj_res, rms = ctx.saved_tensors
        n, mma, norm_eps, rt = ctx.args
        # gp is an fp32 intermediate: rounding it to bf16 would add error the reference math does
        # not have, so the backward MMAs use TF32 at least (x in bf16 is exact in TF32).
        mma = max(mma, MMA_TF32)
        t, k = x.shape
        dev = x.device
        f32 = torch.float32
        grads = (g.contiguous() for g in (grad_pre, grad_post, grad_res))
        tl = tiling.mapping_tiles(n, k)
        m_blocks, k_tiles = _cdiv(t, tl.tile_m), _cdiv(k, tl.tile_k)
        gp_pp = torch.empty((t, 2 * n), dtype=f32, device=dev)
        gp_res = torch.empty((t, n * n), dtype=f32, device=dev)
        cx = torch.empty((t,), dtype=f32, device=dev)
        # Every element of the partial buffers is written by the kernels when t > 0.
        alloc = torch.empty if t else torch.zeros
        gbias_pp = alloc((max(m_blocks, 1), 2 * n), dtype=f32, device=dev)
        gbias_res = alloc((max(m_blocks, 1), n * n), dtype=f32, device=dev)
        galpha = alloc((max(m_blocks, 1), 4), dtype=f32, device=dev)
        splits = tiling.split_count(k_tiles, m_blocks, rt.num_sms(dev)) if t else 1
        per_split = _cdiv(m_blocks, splits) if t else 1
        splits = _cdiv(m_blocks, per_split) if t else 1
        gw_part = alloc((splits, num_mapping_outputs(n), k), dtype=f32, device=dev)
        grad_x = torch.empty_like(x)
        if t:
            rt.launch(
                (m_blocks,),
                "mapping_bwd_coef_kernel",
                (*grads, proj_pp, proj_res, rms, alpha_pre, alpha_post, alpha_res, bias[: 2 * n], bias[2 * n :],
                 gp_pp, gp_res, cx, gbias_pp, gbias_res, galpha, 1.0 / k, norm_eps, n, tl.tile_m),
            )
            rt.launch(
                (k_tiles, splits),
                "mapping_bwd_dx_dw_kernel",
                (x, weight[: 2 * n], weight[2 * n :], gp_pp, gp_res, cx, grad_x, gw_part[:, : 2 * n],
                 gw_part[:, 2 * n :], per_split, n, tl.tile_m, tl.tile_k, mma),
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
            None, None, None, None, None, None,
        )


def _mapping(
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
    op = "mapping"
    spec = get_variant(variant)
    check_streams(n, op=op)
    check_rank(x, 2, name="x", op=op, layout="[T, n*C]")
    width = x.shape[1]
    if width % n != 0 or width == 0:
        raise ValueError(f"{op}: x width n*C={width} is not a positive multiple of n={n}; x is {shape_str(x)}")
    check_dim(weight, (num_mapping_outputs(n), width), name="weight", op=op, layout="[N, n*C]")
    for name, a in (("alpha_pre", alpha_pre), ("alpha_post", alpha_post), ("alpha_res", alpha_res)):
        check_dim(a, (1,), name=name, op=op, layout="[1]")
    check_dim(bias, (num_mapping_outputs(n),), name="bias", op=op, layout="[N]")
    _require_n(n, op)
    tensors = dict(x=x, weight=weight, alpha_pre=alpha_pre, alpha_post=alpha_post, alpha_res=alpha_res, bias=bias)
    _require_dtypes(op, **tensors)
    runtime = rt()
    _require_device(runtime, op, **tensors)
    compute = torch.float32 if spec.mapping_fp32 else x.dtype
    out_dtype = x.dtype if spec.coefficients_in_activation_dtype else compute
    return _MappingFn.apply(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, out_dtype, mma_mode(x.dtype, spec),
        float(spec.h_pre_eps), float(norm_eps), runtime,
    )


# ---------------------------------------------------------------------------------------------
# the op bundle
# ---------------------------------------------------------------------------------------------


class CuTileOps(NamedTuple):
    """The four ops, each with the reference signature, bound to one runtime."""

    sinkhorn: Callable
    mapping: Callable
    h_aggregate: Callable
    h_post_bda: Callable


def make_ops(runtime: Any | Callable[[], Any]) -> CuTileOps:
    """Bind the ops to `runtime` (an object with `launch`, or a zero-argument factory of one)."""
    get = runtime if callable(runtime) and not hasattr(runtime, "launch") else (lambda: runtime)

    def sinkhorn(logits, iterations=20, eps=None, variant=Variant.MEGATRON_MAIN):
        """cuTile `mhc_core.ops.sinkhorn`: `[..., n, n] -> [..., n, n]`."""
        return _sinkhorn(get, logits, iterations, eps, variant)

    def mapping(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant=Variant.MEGATRON_MAIN,
                norm_eps=NORM_EPS):
        """cuTile `mhc_core.ops.mapping`: `x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`."""
        return _mapping(get, x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant, norm_eps)

    def h_aggregate(x, h_pre):
        """cuTile `mhc_core.ops.h_aggregate`: `x [T, n, C], h_pre [T, n] -> [T, C]`."""
        return _h_aggregate(get, x, h_pre)

    def h_post_bda(h_res, residual, h_post, y, bias, dropout_p=0.0, training=False,
                   variant=Variant.MEGATRON_MAIN):
        """cuTile `mhc_core.ops.h_post_bda`: `-> [T, n, C]` (no dropout in training)."""
        return _h_post_bda(get, h_res, residual, h_post, y, bias, dropout_p, training, variant)

    return CuTileOps(sinkhorn=sinkhorn, mapping=mapping, h_aggregate=h_aggregate, h_post_bda=h_post_bda)
