"""`sinkhorn` for the compiled backend: compiled iteration, compiled recompute backward.

The forward saves only the logits `[B, n, n]`; the backward is one compiled function that replays
the iteration (keeping the iterates inside the graph) and applies the per-step VJPs in reverse,
so the bytes kept between forward and backward do not depend on `iterations`.

Per-step VJPs (g' the gradient of the step output m' = m / d, d = guard(S), S = sum_dim m):

    g_m = (g' - guard'(S) * sum_dim(g' * m')) / d        guard' = 1 ("add", "none"), [S >= eps] ("clamp")
    paper, log domain, l' = l - logsumexp_dim(l):   g_l = g' - exp(l') * sum_dim(g')
    starts:  exp(z - rowmax) -> g_z = g_m0 * m0;  softmax(z) + eps -> g_z = p * (g - sum_-1(g * p));
             paper -> g_l(final) = g_out * out

All math in fp32 (fp64 stays fp64), as the reference. The iterations are unrolled into one graph
per direction (one kernel launch on GPU); n is static (a dynamic n makes Inductor's C++ build of
the unrolled graph pathologically slow), the token dim is dynamic. T = 0 and n = 1 run the
reference (for n = 1 the output does not depend on the logits).
"""

from __future__ import annotations

import torch

from mhc_core.kernels.compiled.common import acc_dtype, compile_for, mark_dynamic
from mhc_core.ops.sinkhorn import SinkhornCall, normalisation_dims, sinkhorn_reference
from mhc_core.variants import VariantSpec

__all__ = ["sinkhorn"]


def _divide(m, dim: int, guard: str, eps: float):
    s = m.sum(dim, keepdim=True)
    if guard == "clamp":
        d = s.clamp(min=eps)
    elif guard == "add":
        d = s + eps
    else:
        d = s
    return m / d, d, s


def _tokens_last(t):
    """`[T, n, n]` -> `[n, n, T]`, contiguous: the log-domain steps' exp and log then run in vector lanes over
    the tokens (with `n` innermost, Inductor's C++ code evaluated them lane by lane: `paper`'s forward took
    10.5 ms at T 4096, n 4 on one thread, 4.5 ms this way). The linear-domain starts gain nothing from it."""
    return t.permute(1, 2, 0).contiguous()


def _fwd(z, start: str, order: str, guard: str, iterations: int, eps: float):
    if start == "exp":  # log domain, on [n, n, T]: dims -2 / -1 of [T, n, n] are 0 / 1
        log_m = _tokens_last(z)
        for dim in normalisation_dims(start, order, iterations):
            log_m = log_m - torch.logsumexp(log_m, dim=dim + 2, keepdim=True)
        return torch.exp(log_m).permute(2, 0, 1)
    if start == "exp_rowmax":
        m = torch.exp(z - z.amax(dim=-1, keepdim=True))
    else:
        m = torch.softmax(z, dim=-1) + eps
    for dim in normalisation_dims(start, order, iterations):
        m, _, _ = _divide(m, dim, guard, eps)
    return m


def _bwd(z, g, start: str, order: str, guard: str, iterations: int, eps: float):
    dims = normalisation_dims(start, order, iterations)
    if start == "exp":  # log domain, on [n, n, T] (`_tokens_last`)
        logs = []
        log_m = _tokens_last(z)
        for dim in dims:
            log_m = log_m - torch.logsumexp(log_m, dim=dim + 2, keepdim=True)
            logs.append(log_m)
        g = _tokens_last(g) * torch.exp(log_m)
        for dim, l_out in zip(reversed(dims), reversed(logs), strict=True):
            g = g - torch.exp(l_out) * g.sum(dim + 2, keepdim=True)
        return g.permute(2, 0, 1)
    if start == "exp_rowmax":
        m0 = torch.exp(z - z.amax(dim=-1, keepdim=True))
    else:
        p = torch.softmax(z, dim=-1)
        m0 = p + eps
    m = m0
    saved = []
    for dim in dims:
        m, d, s = _divide(m, dim, guard, eps)
        saved.append((m, d, s))
    for dim, (m_out, d, s) in zip(reversed(dims), reversed(saved), strict=True):
        inner = (g * m_out).sum(dim, keepdim=True)
        if guard == "clamp":
            inner = torch.where(s >= eps, inner, torch.zeros_like(inner))
        g = (g - inner) / d
    if start == "exp_rowmax":
        g = g * m0
        if dims[0] == -1:  # a first row step cancels the rowmax: no gradient through it
            return g
        top = (z == z.amax(dim=-1, keepdim=True)).to(g.dtype)  # amax's gradient: split among the row's maxima
        return g - top / top.sum(-1, keepdim=True) * g.sum(-1, keepdim=True)
    return p * (g - (g * p).sum(-1, keepdim=True))


def _key(z: torch.Tensor, spec: VariantSpec, iterations: int, eps: float):
    return (z.dtype, *spec.sinkhorn_form, iterations, eps, z.shape[-1], z.device.type)


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, iterations: int, eps: float, spec: VariantSpec):
        ctx.iterations, ctx.eps, ctx.spec = iterations, eps, spec
        ctx.save_for_backward(z)
        fwd = compile_for(_fwd, _key(z, spec, iterations, eps))
        return fwd(mark_dynamic(z, 0), *spec.sinkhorn_form, iterations, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        spec = ctx.spec
        bwd = compile_for(_bwd, _key(z, spec, ctx.iterations, ctx.eps))
        z, g = mark_dynamic(z, 0), mark_dynamic(g.contiguous(), 0)
        return bwd(z, g, *spec.sinkhorn_form, ctx.iterations, ctx.eps), None, None, None


def sinkhorn(call: SinkhornCall) -> torch.Tensor:
    """Sinkhorn-Knopp projection (compiled backend) of a checked call (`mhc_core.ops.sinkhorn`).

    Unlike the reference oracle it does not scan the logits for NaN/inf (no host sync).

    Returns:
        `[..., n, n]` in `logits.dtype`.
    """
    logits, spec, iterations, eps = call.logits, call.spec, call.iterations, call.eps
    n = logits.shape[-1]
    if logits.numel() == 0 or n == 1:
        # n = 1: the result does not depend on the logits, and Inductor would inline the
        # reduction-free chain into an expression that doubles with every step.
        return sinkhorn_reference(call)
    z = logits.reshape(-1, n, n).to(acc_dtype(logits.dtype)).contiguous()
    out = _Sinkhorn.apply(z, iterations, eps, spec)
    return out.reshape(logits.shape).to(logits.dtype)
