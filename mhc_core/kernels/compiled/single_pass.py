"""`pre` in the single-pass form (DeepSeek-V4.1) for the compiled backend: one read of the streams per sublayer.

Forward (x `[T, K]`, K = n*C; mix `[T, n]`, the previous sublayer's `H_pre`): the projection, the RMS factor and
the gates of this sublayer (the next `H_pre`, `H_post`, the residual logits), Sinkhorn, and the aggregate
`sum_i mix_i x_i` of the same `x`, one compiled graph; on CPU the native kernel's one read of each block of tokens
(`mhc_core.kernels.native`, `mix` given: the projection and the sum of squares, then the aggregate with `mix` from
cache) with a small compiled graph for `H_post` and `H_res`. Saved for the backward: `x`, the parameters,
`mix`, `proj [T, N]` and `rms [T, 1]`.

Backward, the same shape as the per-sublayer pre's (`mhc_core.kernels.compiled.pre`) with the aggregate's
gradient going to `mix` instead of into this sublayer's gates:

    g_mix    = sum_c g_agg * x_i                                                [T, n]
    gh       = gate derivatives of (g_next_h_pre, g_h_post, g_logits)           [T, N]
    g_x      = (gh * r * alpha) @ W + c * x + mix (x) g_agg                     [T, K]
    g_W      = (gh * r * alpha)^T @ x;  g_alpha, g_bias: sums over tokens

At the model's entry (no previous `H_pre`) `mix` is the identity mix (1 on stream 0): the aggregate is exactly
stream 0, as the reference's copy, and its gradient reaches stream 0 only.
"""

from __future__ import annotations

import torch

from mhc_core.kernels import native
from mhc_core.kernels.compiled.aggregate import _fwd as _aggregate_fwd
from mhc_core.kernels.compiled.common import acc_dtype, compile_for, mark_dynamic
from mhc_core.kernels.compiled.mapping import _fwd as _mapping_fwd
from mhc_core.kernels.compiled.pre import _bwd_gates, _epilogue, _native_passes
from mhc_core.kernels.compiled.sinkhorn import _fwd as _sinkhorn_fwd
from mhc_core.ops.mapping import effective_norm_eps
from mhc_core.ops.pre import PreCall, pre_reference
from mhc_core.ops.single_pass import entry_mix
from mhc_core.variants import VariantSpec

__all__ = ["single_pass_pre"]


def _fwd(
    x,
    weight,
    a_pre,
    a_post,
    a_res,
    bias,
    mix,
    n: int,
    compute,
    out_dtype,
    h_pre_eps: float,
    norm_eps: float,
    eps_inside: bool,
    start: str,
    order: str,
    guard: str,
    iterations: int,
    s_eps: float,
):
    h_pre, h_post, logits, proj, rms = _mapping_fwd(
        x, weight, a_pre, a_post, a_res, bias, n, compute, out_dtype, h_pre_eps, norm_eps, eps_inside
    )
    h_res = _sinkhorn_fwd(logits.to(acc_dtype(logits.dtype)), start, order, guard, iterations, s_eps).to(
        logits.dtype
    )
    t, k = x.shape
    return _aggregate_fwd(x.view(t, n, k // n), mix), h_pre, h_post, h_res, proj, rms


def _bwd(
    g_agg,
    g_pre,
    g_post,
    g_res,
    x,
    weight,
    a_pre,
    a_post,
    a_res,
    bias,
    mix,
    proj,
    rms,
    n: int,
    compute,
    out_dtype,
    h_pre_eps: float,
    eps_outside: float,
    start: str,
    order: str,
    guard: str,
    iterations: int,
    s_eps: float,
    need_x: bool,
    need_w: bool,
    need_mix: bool,
):
    acc = acc_dtype(compute)
    t, k = x.shape
    c = k // n
    a_acc = acc_dtype(x.dtype, mix.dtype)
    g_aggf = g_agg.to(a_acc)
    g_mix = (g_aggf[:, None, :] * x.view(t, n, c).to(a_acc)).sum(-1).to(mix.dtype) if need_mix else None
    g_proj, coef, _, g_params = _bwd_gates(
        None,
        g_pre,
        g_post,
        g_res,
        a_pre,
        a_post,
        a_res,
        bias,
        proj,
        rms,
        n,
        k,
        compute,
        out_dtype,
        h_pre_eps,
        eps_outside,
        start,
        order,
        guard,
        iterations,
        s_eps,
    )
    g_x = g_w = None
    if need_x:
        g_mm = (g_proj.to(compute) @ weight.to(compute)).view(t, n, c).to(acc)
        g_x = (
            (
                g_mm
                + coef.view(t, 1, 1) * x.view(t, n, c).to(compute).to(acc)
                + mix.to(acc)[:, :, None] * g_aggf[:, None, :].to(acc)
            )
            .to(x.dtype)
            .view(t, k)
        )
    if need_w:
        g_w = (g_proj.to(compute).t() @ x.to(compute)).to(weight.dtype)
    return g_x, g_w, *g_params, g_mix


def _native_bwd(grads, x, params, mix, proj, rms, n: int, ctx, need: tuple[bool, bool, bool], key: tuple):
    """The backward with the native kernel's passes over x around the compiled gates: the gradient of `mix`
    (one read of x and g_agg, only where `mix` needs it), `_bwd_gates`, then the gradients of x and W (one more)."""
    g_agg, g_pre, g_post, g_res = grads
    weight, a_pre, a_post, a_res, bias = params
    need_x, need_w, need_mix = need
    t, k = x.shape
    g_mix = native.grad_h(x, g_agg, n).to(mix.dtype) if need_mix else None
    g_proj, coef, _, g_params = compile_for(_bwd_gates, ("native-single-pass", *key))(
        None,
        g_pre,
        g_post,
        g_res,
        a_pre,
        a_post,
        a_res,
        bias,
        proj,
        rms,
        n,
        k,
        ctx.compute,
        ctx.out_dtype,
        ctx.h_pre_eps,
        ctx.eps_outside,
        *ctx.sink,
    )
    g_x, g_w = native.grad_x_w(
        x,
        g_agg,
        weight.detach().to(ctx.compute),
        g_proj.to(ctx.compute),
        coef,
        mix,
        n,
        need_x,
        need_w,
        bf16_products=ctx.compute == torch.bfloat16,
    )
    return g_x, None if g_w is None else g_w.to(ctx.compute).to(weight.dtype), *g_params, g_mix


class _SinglePassPre(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        a_pre,
        a_post,
        a_res,
        bias,
        mix,
        n: int,
        iterations: int,
        spec: VariantSpec,
        norm_eps: float,
    ):
        compute = acc_dtype(x.dtype) if spec.mapping_fp32 else x.dtype
        norm_eps = effective_norm_eps(spec, norm_eps, compute)
        out_dtype = x.dtype if spec.coefficients_in_activation_dtype else compute
        params = (weight, a_pre, a_post, a_res, bias)
        sink = (*spec.sinkhorn_form, iterations, spec.sinkhorn_eps)
        pre_key = (  # the per-sublayer pre's: its native epilogue's graph is this one's too
            x.dtype,
            *(p.dtype for p in params),
            n,
            compute,
            out_dtype,
            spec.h_pre_eps,
            norm_eps,
            spec.norm_eps_placement,
            *sink,
            x.device.type,
        )
        eps_outside = 0.0 if spec.norm_eps_inside else norm_eps
        native_fwd, ctx.native = _native_passes(x, compute, n)
        native_fwd = native_fwd and mix.dtype in (torch.float32, torch.bfloat16)
        ctx.native = ctx.native and native_fwd
        if native_fwd:
            proj, rms, h_pre, agg = native.pre_forward(
                x,
                weight,
                a_pre,
                bias,
                n,
                norm_eps,
                spec.norm_eps_inside,
                spec.h_pre_eps,
                out_dtype,
                compute,
                mix=mix,
            )
            h_post, h_res = compile_for(_epilogue, ("native", *pre_key))(
                mark_dynamic(proj, 0),
                mark_dynamic(rms, 0),
                a_pre,
                a_post,
                a_res,
                bias,
                n,
                compute,
                out_dtype,
                eps_outside,
                *sink,
            )
        else:
            agg, h_pre, h_post, h_res, proj, rms = compile_for(_fwd, (*pre_key, mix.dtype))(
                mark_dynamic(x, 0),
                *params,
                mark_dynamic(mix, 0),
                n,
                compute,
                out_dtype,
                spec.h_pre_eps,
                norm_eps,
                spec.norm_eps_inside,
                *sink,
            )
        ctx.save_for_backward(x, *params, mix, proj, rms)
        ctx.n, ctx.compute, ctx.out_dtype, ctx.h_pre_eps = n, compute, out_dtype, spec.h_pre_eps
        ctx.eps_outside = eps_outside
        ctx.sink = sink
        return agg, h_pre, h_post, h_res

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_agg, g_pre, g_post, g_res):
        x, weight, a_pre, a_post, a_res, bias, mix, proj, rms = ctx.saved_tensors
        n, t = ctx.n, x.shape[0]
        like = (
            ((t, x.shape[1] // n), x.dtype),
            ((t, n), ctx.out_dtype),
            ((t, n), ctx.out_dtype),
            ((t, n, n), ctx.out_dtype),
        )
        grads = [
            mark_dynamic(torch.zeros(shape, dtype=dtype, device=x.device) if g is None else g.contiguous(), 0)
            for g, (shape, dtype) in zip((g_agg, g_pre, g_post, g_res), like, strict=True)
        ]
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[6])
        params = (weight, a_pre, a_post, a_res, bias)
        key = (
            x.dtype,
            *(p.dtype for p in params),
            mix.dtype,
            *(g.dtype for g in grads),
            n,
            ctx.compute,
            ctx.out_dtype,
            ctx.h_pre_eps,
            ctx.eps_outside,
            *ctx.sink,
            *need,
            x.device.type,
        )
        x, mix, proj, rms = (mark_dynamic(v, 0) for v in (x, mix, proj, rms))
        if ctx.native:
            out = _native_bwd(grads, x, params, mix, proj, rms, n, ctx, need, key)
        else:
            out = compile_for(_bwd, key)(
                *grads,
                x,
                *params,
                mix,
                proj,
                rms,
                n,
                ctx.compute,
                ctx.out_dtype,
                ctx.h_pre_eps,
                ctx.eps_outside,
                *ctx.sink,
                *need,
            )
        return (*out, None, None, None, None)


def single_pass_pre(call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The single-pass sublayer's pre-op (compiled backend) of a checked call (`PreCall.single_pass`).

    Returns:
        `aggregate [T, C]` (with the previous `H_pre`; stream 0 at the entry), `next_h_pre [T, n]`, `h_post [T, n]`,
        `h_res [T, n, n]`.
    """
    if call.x.shape[0] == 0 or call.n == 1:
        return pre_reference(call)
    mix = call.previous_h_pre
    if mix is None:
        mix = entry_mix(call.x.shape[0], call.n, device=call.x.device)
    return _SinglePassPre.apply(
        call.x.contiguous(),
        call.weight.contiguous(),
        call.alpha_pre,
        call.alpha_post,
        call.alpha_res,
        call.bias.contiguous(),
        mix.contiguous(),
        call.n,
        call.iterations,
        call.spec,
        call.norm_eps,
    )
