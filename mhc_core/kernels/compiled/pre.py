"""`pre` for the compiled backend: mapping, Sinkhorn and aggregate as one compiled forward and one backward.

Forward (x `[T, K]`, K = n*C): the mapping (`proj = x @ W^T`, the row sums of squares, the gates), the
Sinkhorn iteration of the residual logits and the aggregate `sum_i h_pre_i x_i`, one compiled graph;
saved for the backward are `x`, the parameters, `proj [T, N]` and `rms [T, 1]` (as the compiled
mapping), nothing of Sinkhorn or the aggregate: the gates and logits are recomputed from `proj`.

On CPU, where the mapping computes in fp32 (fp32 activations, or a variant with fp32 mappings) or in bf16 on
bf16 activations, and n <= 8 (`native.passes`), the forward's passes over `x` are the native kernel's instead
(`mhc_core.kernels.native`: the projection, the sum of squares, h_pre and the aggregate in one read of each
block of tokens; Inductor's graph reads `x` three times, its GEMM being an extern call), and a small compiled
graph makes h_post and h_res from its `proj` and `rms`. `MHC_NATIVE=0` keeps the compiled graph.

Backward, one compiled graph, one gradient of `x` (where the unfused ops give two, mapping's and the
aggregate's, that autograd adds in a pass of its own):

    g_logits = Sinkhorn VJP (recomputed iterates)          g_h_pre += sum_c g_agg * x_i     [T, n]
    gh       = gate derivatives of (g_h_pre, g_h_post, g_logits)                            [T, N]
    g_x      = (gh * r * alpha) @ W + c * x + h_pre (x) g_agg                               [T, K]
    g_W      = (gh * r * alpha)^T @ x;  g_alpha, g_bias: sums over tokens

with `c = -sum_k(gh_k * proj_k * alpha_k) * r^2 / (rms * K)`, all accumulated in fp32 (fp64 stays fp64)
and `g_x` rounded once to `x.dtype`. Precision per variant as the reference ops.

On CPU, where the forward was native and the mapping computes in fp32 (or in bf16 under the `avx512_bf16`
kernel, `native.passes`), the passes over `x` of the backward are the native kernel's too (`_native_bwd`):
`g_h_pre`'s sum over C in one read of `x` and `g_agg`, the gates (`_bwd_gates`, compiled, on `[T, N]` tensors),
then `g_x` and `g_W` together in one more, `g_W` summed in fp32 (rounded to bf16 after, for a bf16 mapping, as
its GEMM's output) (the compiled graph reads `x` three times and writes the GEMM's product before the pointwise
pass reads it).
"""

from __future__ import annotations

import torch

from mhc_core.kernels import native
from mhc_core.kernels.compiled.aggregate import _fwd as _aggregate_fwd
from mhc_core.kernels.compiled.common import acc_dtype, compile_for, mark_dynamic
from mhc_core.kernels.compiled.mapping import _alpha, gate_grads, rms_coef
from mhc_core.kernels.compiled.mapping import _fwd as _mapping_fwd
from mhc_core.kernels.compiled.sinkhorn import _bwd as _sinkhorn_bwd
from mhc_core.kernels.compiled.sinkhorn import _fwd as _sinkhorn_fwd
from mhc_core.ops.mapping import effective_norm_eps
from mhc_core.ops.pre import PreCall, pre_reference
from mhc_core.ops.single_pass import entry_mix
from mhc_core.variants import VariantSpec

__all__ = ["pre"]


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
    z = logits.to(acc_dtype(logits.dtype))
    h_res = _sinkhorn_fwd(z, start, order, guard, iterations, s_eps).to(logits.dtype)
    t, k = x.shape
    aggregate = _aggregate_fwd(x.view(t, n, k // n), h_pre if mix is None else mix)
    return aggregate, h_pre, h_post, h_res, proj, rms


def _epilogue(
    proj,
    rms,
    a_pre,
    a_post,
    a_res,
    bias,
    n: int,
    compute,
    out_dtype,
    eps_outside: float,
    start: str,
    order: str,
    guard: str,
    iterations: int,
    s_eps: float,
):
    """h_post and h_res from the native forward's `proj [T, N]` and `rms [T, 1]` (the gates as `_fwd` computes them)."""
    acc = acc_dtype(compute)
    t = proj.shape[0]
    alpha = _alpha(a_pre, a_post, a_res, n, compute, acc)
    h = (1.0 / (rms + eps_outside)) * proj.to(acc) * alpha + bias.to(compute).to(acc)
    h_post = (2.0 * torch.sigmoid(h[:, n : 2 * n])).to(out_dtype)
    logits = h[:, 2 * n :].reshape(t, n, n).to(out_dtype)
    h_res = _sinkhorn_fwd(logits.to(acc_dtype(logits.dtype)), start, order, guard, iterations, s_eps).to(
        logits.dtype
    )
    return h_post, h_res


def _native_passes(x: torch.Tensor, compute: torch.dtype, n: int) -> tuple[bool, bool]:
    """Whether the native kernels take this call's forward and backward (`native.passes`, on CPU tensors; the
    chosen kernel is None where none runs, `MHC_NATIVE=0` or `_pre` not built)."""
    if x.device.type != "cpu":
        return False, False
    return native.passes(x.dtype, compute, n, native.chosen_kernel())


def _bwd_gates(
    g_h_agg,
    g_pre,
    g_post,
    g_res,
    a_pre,
    a_post,
    a_res,
    bias,
    proj,
    rms,
    n: int,
    k: int,
    compute,
    out_dtype,
    h_pre_eps: float,
    eps_outside: float,
    start: str,
    order: str,
    guard: str,
    iterations: int,
    s_eps: float,
):
    """The backward up to the gradient of the projection: from `g_h_agg [T, n]`, the aggregate's gradient of h_pre
    (None in the single-pass form, whose aggregate weights are the previous sublayer's), and the coefficients' gradients, `g_proj [T, N]`, `coef [T, 1]` (the RMS term of the gradient of x), h_pre
    `[T, n]` as the forward used it, and the gradients of alpha_pre, alpha_post, alpha_res and bias."""
    acc = acc_dtype(compute)
    t = proj.shape[0]
    alpha = _alpha(a_pre, a_post, a_res, n, compute, acc)
    projf = proj.to(acc)
    r = 1.0 / (rms + eps_outside)
    h = r * projf * alpha + bias.to(compute).to(acc)
    s_pre = torch.sigmoid(h[:, :n])
    s_post = torch.sigmoid(h[:, n : 2 * n])
    h_pre = (s_pre + h_pre_eps).to(out_dtype)
    logits = h[:, 2 * n :].reshape(t, n, n).to(out_dtype)
    s_acc = acc_dtype(logits.dtype)
    g_logits = _sinkhorn_bwd(
        logits.to(s_acc), g_res.to(logits.dtype).to(s_acc), start, order, guard, iterations, s_eps
    )
    g_pre_total = g_pre.to(acc) if g_h_agg is None else g_pre.to(acc) + g_h_agg.to(acc)  # [T, n]
    gh = torch.cat(
        [
            g_pre_total * s_pre * (1.0 - s_pre),
            g_post.to(acc) * 2.0 * s_post * (1.0 - s_post),
            g_logits.to(out_dtype).reshape(t, n * n).to(acc),
        ],
        dim=1,
    )  # [T, N]
    g_proj, g_params = gate_grads(gh, r, projf, alpha, n, (a_pre, a_post, a_res, bias))
    return g_proj, rms_coef(gh, projf, alpha, r, rms, k), h_pre, g_params


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
    a_acc = acc_dtype(x.dtype, out_dtype if mix is None else mix.dtype)
    g_aggf = g_agg.to(a_acc)
    g_h_agg = None  # the aggregate's gradient of its weights [T, n]: h_pre's, or (single-pass) the mix's
    if mix is None or need_mix:
        g_h_agg = (g_aggf[:, None, :] * x.view(t, n, c).to(a_acc)).sum(-1)
    g_proj, coef, h_pre, g_params = _bwd_gates(
        g_h_agg if mix is None else None,
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
    weights = h_pre if mix is None else mix
    g_x = g_w = None
    if need_x:
        # One pointwise pass after the GEMM adds c * x and weights (x) g_agg to its product, read as [T, n, C] (the
        # view keeps Inductor from folding c * x into an addmm, which writes c * x to a [T, K] buffer of its own
        # and copies it into the product's).
        g_mm = (g_proj.to(compute) @ weight.to(compute)).view(t, n, c).to(acc)
        g_x = (
            (
                g_mm
                + coef.view(t, 1, 1) * x.view(t, n, c).to(compute).to(acc)
                + weights.to(acc)[:, :, None] * g_aggf[:, None, :].to(acc)
            )
            .to(x.dtype)
            .view(t, k)
        )
    if need_w:
        g_w = (g_proj.to(compute).t() @ x.to(compute)).to(weight.dtype)
    g_mix = None if mix is None or g_h_agg is None else g_h_agg.to(mix.dtype)
    return g_x, g_w, *g_params, g_mix


def _native_bwd(
    grads,
    x,
    params,
    mix,
    proj,
    rms,
    n: int,
    compute,
    out_dtype,
    h_pre_eps: float,
    eps_outside: float,
    sink: tuple,
    need: tuple[bool, bool, bool],
    key: tuple,
):
    """The backward with the native kernel's two passes over x around the compiled gates: the aggregate's gradient
    of its weights (one read of x and g_agg; single-pass: the mix's, only where the mix needs one), `_bwd_gates`,
    then the gradients of x and W (one more)."""
    g_agg, g_pre, g_post, g_res = grads
    weight, a_pre, a_post, a_res, bias = params
    need_x, need_w, need_mix = need
    t, k = x.shape
    g_h_agg = native.grad_h(x, g_agg, n) if mix is None or need_mix else None
    g_proj, coef, h_pre, g_params = compile_for(_bwd_gates, ("native", *key))(
        mark_dynamic(g_h_agg, 0) if mix is None else None,
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
        *sink,
    )
    # The mapping's GEMMs read g_proj and W in its dtype: rounded to it first, as they would be, and their gradient
    # of W leaves in it.
    g_x, g_w = native.grad_x_w(
        x,
        g_agg,
        weight.detach().to(compute),
        g_proj.to(compute),
        coef,
        h_pre if mix is None else mix,
        n,
        need_x,
        need_w,
        bf16_products=compute == torch.bfloat16,
    )
    g_mix = None if mix is None or g_h_agg is None else g_h_agg.to(mix.dtype)
    return g_x, None if g_w is None else g_w.to(compute).to(weight.dtype), *g_params, g_mix


class _Pre(torch.autograd.Function):
    """Both forms: `mix` None, the per-sublayer pre (the aggregate weighted with this sublayer's h_pre, its gradient
    into the gates); `mix [T, n]`, the single-pass one (weighted with the previous sublayer's H_pre, its gradient
    the mix's)."""

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
        key = (
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
        native_fwd, native_bwd = _native_passes(x, compute, n)
        if mix is not None and mix.dtype not in (torch.float32, torch.bfloat16):
            native_fwd = native_bwd = False  # the native kernels read the mix as fp32 or bf16
        ctx.native = native_bwd
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
            h_post, h_res = compile_for(_epilogue, ("native", *key))(
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
            agg, h_pre, h_post, h_res, proj, rms = compile_for(
                _fwd, (*key, None if mix is None else mix.dtype)
            )(
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
        like = {
            "g_agg": ((t, x.shape[1] // n), x.dtype),
            "g_pre": ((t, n), ctx.out_dtype),
            "g_post": ((t, n), ctx.out_dtype),
            "g_res": ((t, n, n), ctx.out_dtype),
        }
        grads = []
        for g, (shape, dtype) in zip((g_agg, g_pre, g_post, g_res), like.values(), strict=True):
            grads.append(
                mark_dynamic(
                    torch.zeros(shape, dtype=dtype, device=x.device) if g is None else g.contiguous(), 0
                )
            )
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[6])
        params = (weight, a_pre, a_post, a_res, bias)
        key = (
            x.dtype,
            *(p.dtype for p in params),
            None if mix is None else mix.dtype,
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
            out = _native_bwd(
                grads,
                x,
                params,
                mix,
                proj,
                rms,
                n,
                ctx.compute,
                ctx.out_dtype,
                ctx.h_pre_eps,
                ctx.eps_outside,
                ctx.sink,
                need,
                key,
            )
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


def pre(call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sublayer's pre-op (compiled backend) of a checked call (`mhc_core.ops.pre`), in either form: single-pass,
    the aggregate weighted with the previous sublayer's H_pre, or at the model's entry with the identity mix (1 on
    stream 0: the aggregate is exactly stream 0, as the reference's copy, and its gradient reaches stream 0 only).

    Returns:
        `aggregate [T, C]`, `h_pre [T, n]` (single-pass: the next sublayer's), `h_post [T, n]`, `h_res [T, n, n]`.
    """
    if call.x.shape[0] == 0 or call.n == 1:
        return pre_reference(call)
    mix = None
    if call.single_pass:
        mix = call.previous_h_pre
        if mix is None:
            mix = entry_mix(call.x.shape[0], call.n, device=call.x.device)
        mix = mix.contiguous()
    return _Pre.apply(
        call.x.contiguous(),
        call.weight.contiguous(),
        call.alpha_pre,
        call.alpha_post,
        call.alpha_res,
        call.bias.contiguous(),
        mix,
        call.n,
        call.iterations,
        call.spec,
        call.norm_eps,
    )
