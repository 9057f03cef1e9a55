"""`mapping` for the compiled backend: projection + RMS + coefficients, with a fused backward.

Forward (x `[T, K]`, K = n*C, weight `[N, K]`, N = n*n + 2n):

    proj = x @ W^T                                  [T, N]    (compute dtype of the variant)
    rms  = ||x||_2 / sqrt(K);  r = 1 / (rms + eps)  [T, 1]    (sum of squares in fp32)
    rms  = sqrt(||x||_2^2 / K + eps);  r = 1 / rms          with the eps inside the square root
    h    = r * proj * alpha + bias                  [T, N]    epilogue: gates, sigmoid, split

`proj` and `rms` (`T * (N + 1)` values) are saved for the backward, so it never recomputes the
projection. Backward, with `gh` the gradient w.r.t. `h` (sigmoid derivatives applied):

    g_bias  = sum_t gh                 g_alpha_k = sum_t gh_k * r * proj_k (summed per gate)
    g_proj  = gh * r * alpha           g_r = sum_k gh_k * proj_k * alpha_k
    g_x     = g_proj @ W - g_r * r^2 * x / (rms * K)    (0 where rms = 0, as autograd's norm; either eps)
    g_W     = g_proj^T @ x

Precision per variant as the reference: parameters are rounded to the compute dtype
(`megatron_main`: the activation dtype; `paper`, `megatron_dev`: fp32), the two matmuls run in the
compute dtype, everything else accumulates in fp32.
"""

from __future__ import annotations

import math

import torch

from mhc_core.kernels.compiled.common import acc_dtype, compile_for, mark_dynamic
from mhc_core.ops.mapping import MappingCall, effective_norm_eps, mapping_reference
from mhc_core.variants import VariantSpec

__all__ = ["mapping"]


def _alpha(a_pre, a_post, a_res, n: int, compute, acc):
    return torch.cat(
        [
            a_pre.to(compute).expand(n),
            a_post.to(compute).expand(n),
            a_res.to(compute).expand(n * n),
        ]
    ).to(acc)


def _rms_and_scale(
    sumsq: torch.Tensor, width: int, norm_eps: float, eps_inside: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms, r)` from the row sums of squares `sumsq [T, 1]`: `rms = sqrt(sumsq / K (+ eps inside))`,
    `r = 1 / (rms (+ eps outside))`. With the eps outside, `rms` is `sqrt(sumsq) / sqrt(K)`, as upstream
    computes it. Either way `dr/dx = -r^2 * x / (K * rms)`, so a backward needs only the saved `rms`."""
    if eps_inside:
        rms = torch.sqrt(sumsq / width + norm_eps)
        return rms, 1.0 / rms
    rms = torch.sqrt(sumsq) / math.sqrt(width)
    return rms, 1.0 / (rms + norm_eps)


_SQUARES_BLOCK = 256


def _sum_squares(xa: torch.Tensor) -> torch.Tensor:
    """`[T, K] -> [T, 1]`, the row sums of squares, in blocks of 256 columns first where K allows: Inductor's
    C++ backend vectorises a short inner reduction without its cascade-summation helper, which makes the
    pass over `x` faster (`docs/kernels.md`, the CPU targets)."""
    t, k = xa.shape
    sq = xa * xa
    if k % _SQUARES_BLOCK == 0:
        sq = sq.view(t, k // _SQUARES_BLOCK, _SQUARES_BLOCK).sum(-1)
    return sq.sum(-1, keepdim=True)


def _fwd(
    x,
    weight,
    a_pre,
    a_post,
    a_res,
    bias,
    n: int,
    compute,
    out_dtype,
    h_pre_eps: float,
    norm_eps: float,
    eps_inside: bool,
):
    acc = acc_dtype(compute)
    k = x.shape[1]
    xc = x.to(compute)
    proj = xc @ weight.to(compute).t()  # [T, N]
    rms, r = _rms_and_scale(_sum_squares(xc.to(acc)), k, norm_eps, eps_inside)  # [T, 1] each
    h = r * proj.to(acc) * _alpha(a_pre, a_post, a_res, n, compute, acc) + bias.to(compute).to(acc)
    h_pre = torch.sigmoid(h[:, :n]) + h_pre_eps
    h_post = 2.0 * torch.sigmoid(h[:, n : 2 * n])
    logits = h[:, 2 * n :].reshape(x.shape[0], n, n)
    return h_pre.to(out_dtype), h_post.to(out_dtype), logits.to(out_dtype), proj, rms


def gate_grads(gh, r, projf, alpha, n: int, params) -> tuple:
    """From the gradient `gh [T, N]` of `h = r * proj * alpha + bias`: `g_proj [T, N]` and the gradients of
    `params = (alpha_pre, alpha_post, alpha_res, bias)`, each in its parameter's dtype."""
    a_pre, a_post, a_res, bias = params
    g_alpha = (gh * r * projf).sum(0)  # [N]
    g_a_pre = g_alpha[:n].sum().reshape(1).to(a_pre.dtype)
    g_a_post = g_alpha[n : 2 * n].sum().reshape(1).to(a_post.dtype)
    g_a_res = g_alpha[2 * n :].sum().reshape(1).to(a_res.dtype)
    return gh * r * alpha, (g_a_pre, g_a_post, g_a_res, gh.sum(0).to(bias.dtype))


def rms_coef(gh, projf, alpha, r, rms, k: int):
    """`c [T, 1]` with `dL/dx = g_proj @ W + c * x` from the RMS scale `r` (either eps placement, from the saved
    `rms`; 0 where `rms` is 0, as autograd's norm)."""
    g_r = (gh * projf * alpha).sum(-1, keepdim=True)  # [T, 1]
    return torch.where(rms > 0, -g_r * r * r / (rms * k), torch.zeros_like(rms))


def _bwd(
    g_pre,
    g_post,
    g_logits,
    x,
    weight,
    a_pre,
    a_post,
    a_res,
    bias,
    proj,
    rms,
    n: int,
    compute,
    eps_outside: float,
    need_x: bool,
    need_w: bool,
):
    acc = acc_dtype(compute)
    t, k = x.shape
    alpha = _alpha(a_pre, a_post, a_res, n, compute, acc)
    projf = proj.to(acc)
    r = 1.0 / (rms + eps_outside)
    h = r * projf * alpha + bias.to(compute).to(acc)
    s_pre = torch.sigmoid(h[:, :n])
    s_post = torch.sigmoid(h[:, n : 2 * n])
    gh = torch.cat(
        [
            g_pre.to(acc) * s_pre * (1.0 - s_pre),
            g_post.to(acc) * 2.0 * s_post * (1.0 - s_post),
            g_logits.reshape(t, n * n).to(acc),
        ],
        dim=1,
    )  # [T, N]
    g_proj, g_params = gate_grads(gh, r, projf, alpha, n, (a_pre, a_post, a_res, bias))
    g_x = g_w = None
    if need_x:
        coef = rms_coef(gh, projf, alpha, r, rms, k)
        g_x = ((g_proj.to(compute) @ weight.to(compute)).to(acc) + coef * x.to(compute).to(acc)).to(x.dtype)
    if need_w:
        g_w = (g_proj.to(compute).t() @ x.to(compute)).to(weight.dtype)
    return g_x, g_w, *g_params


class _Mapping(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, a_pre, a_post, a_res, bias, n: int, spec: VariantSpec, norm_eps: float):
        compute = acc_dtype(x.dtype) if spec.mapping_fp32 else x.dtype
        norm_eps = effective_norm_eps(spec, norm_eps, compute)
        out_dtype = x.dtype if spec.coefficients_in_activation_dtype else compute
        params = (weight, a_pre, a_post, a_res, bias)
        key = (
            x.dtype,
            *(p.dtype for p in params),
            n,
            compute,
            out_dtype,
            spec.h_pre_eps,
            norm_eps,
            spec.norm_eps_placement,
            x.device.type,
        )
        fwd = compile_for(_fwd, key)
        h_pre, h_post, logits, proj, rms = fwd(
            mark_dynamic(x, 0), *params, n, compute, out_dtype, spec.h_pre_eps, norm_eps, spec.norm_eps_inside
        )
        ctx.save_for_backward(x, *params, proj, rms)
        ctx.n, ctx.compute, ctx.norm_eps = n, compute, 0.0 if spec.norm_eps_inside else norm_eps
        return h_pre, h_post, logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_pre, g_post, g_logits):
        x, weight, a_pre, a_post, a_res, bias, proj, rms = ctx.saved_tensors
        n, compute, norm_eps = ctx.n, ctx.compute, ctx.norm_eps
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads_out = []
        for g, like in ((g_pre, (x.shape[0], n)), (g_post, (x.shape[0], n)), (g_logits, (x.shape[0], n, n))):
            grads_out.append(proj.new_zeros(like) if g is None else g.contiguous())
        grads_out = [mark_dynamic(g, 0) for g in grads_out]
        x, proj, rms = (mark_dynamic(t, 0) for t in (x, proj, rms))
        params = (weight, a_pre, a_post, a_res, bias)
        key = (
            x.dtype,
            *(p.dtype for p in params),
            *(g.dtype for g in grads_out),
            n,
            compute,
            norm_eps,
            need_x,
            need_w,
            x.device.type,
        )
        grads = compile_for(_bwd, key)(
            *grads_out, x, *params, proj, rms, n, compute, norm_eps, need_x, need_w
        )
        return (*grads, None, None, None)


def mapping(call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one mHC sublayer (compiled backend) of a checked call (`mhc_core.ops.mapping`).

    Returns:
        `h_pre [T, n]`, `h_post [T, n]`, `h_res_logits [T, n, n]`.
    """
    if call.x.shape[0] == 0:
        return mapping_reference(call)
    return _Mapping.apply(
        call.x.contiguous(),
        call.weight.contiguous(),
        call.alpha_pre,
        call.alpha_post,
        call.alpha_res,
        call.bias.contiguous(),
        call.n,
        call.spec,
        call.norm_eps,
    )
