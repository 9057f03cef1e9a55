"""Sinkhorn-Knopp projection onto doubly stochastic matrices, in the three variants.

`sinkhorn(logits[..., n, n], iterations, eps=None, variant=...) -> [..., n, n]`

The autograd function saves only its input: the backward recomputes the iterations from it, so the
bytes kept for backward do not grow with `iterations`.

The iteration reads the variant's Sinkhorn fields (`VariantSpec.sinkhorn_start`, `_order`, `_guard`,
`_eps`; `normalisation_dims` is the step order every backend shares), so a variant that recombines them
needs no code here. The three variants (see `mhc_core.variants`):
- `paper`: `M = exp(Z)`, then `iterations` times column-normalise, row-normalise. Computed in the
  log domain (`log M -= logsumexp`), which is the same arithmetic without overflow: the row sums
  are exact after any iteration count, at any logit scale.
- `megatron_main`: `M = exp(Z - rowmax(Z))`, then row / `clamp(rowsum, eps)`, column /
  `clamp(colsum, eps)`; eps = 1e-6. Column sums are exact unless a whole column underflows
  (every logit in it more than ~87 below its row maximum in fp32), where upstream's clamp
  leaves that column at zero.
- `megatron_dev`: `M = softmax(Z) + eps`, one column step, then `iterations - 1` times row /
  `(rowsum + eps)`, column / `(colsum + eps)`; eps = 1e-6. No sum is exact: the last column sums
  are `S / (S + eps)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mhc_core.checks import check_finite, check_floating, check_int, check_number, check_rank, shape_str
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = [
    "SinkhornBackend",
    "SinkhornCall",
    "sinkhorn",
    "sinkhorn_iterate",
    "sinkhorn_reference",
    "check_sinkhorn_args",
    "normalisation_dims",
]


def check_sinkhorn_args(
    logits: torch.Tensor, iterations: int, eps: float | None, spec: VariantSpec, *, op: str = "sinkhorn"
) -> tuple[int, float]:
    """The argument checks of `sinkhorn`, shared by every backend; returns `(iterations, eps)` to use:
    `iterations` as a Python int, `eps` resolved.

    `logits` must be a floating `[..., n, n]` tensor with n >= 1, `iterations` an int >= 1 and
    `eps` None (the variant's `spec.sinkhorn_eps`) or >= 0. No NaN / inf scan: that is the
    reference's own `check_finite` call.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        check_rank(logits, 2, name="logits", op=op, layout="[..., n, n]")
    if logits.shape[-1] != logits.shape[-2] or logits.shape[-1] < 1:
        raise ValueError(f"{op}: logits must have shape [..., n, n] with n >= 1, got {shape_str(logits)}")
    iterations = check_int(iterations, name="iterations", op=op)
    eps = spec.sinkhorn_eps if eps is None else check_number(eps, name="eps", op=op, low=0.0)
    check_floating(op=op, logits=logits)
    return iterations, eps


def _normalise(m: torch.Tensor, dim: int, guard: str, eps: float) -> torch.Tensor:
    s = m.sum(dim=dim, keepdim=True)
    if guard == "clamp":
        return m / s.clamp(min=eps)
    if guard == "add":
        return m / (s + eps)
    return m / s


def normalisation_dims(start: str, order: str, iterations: int) -> list[int]:
    """The dims normalised after the start map, in order (-1 a row step, -2 a column step): `iterations`
    pairs in `order`, less the first row step under `softmax_eps` (the softmax is that step)."""
    dims = [-2, -1] * iterations if order == "col_row" else [-1, -2] * iterations
    return dims[1:] if start == "softmax_eps" else dims


def sinkhorn_iterate(logits: torch.Tensor, iterations: int, eps: float, spec: VariantSpec) -> torch.Tensor:
    """The plain differentiable iteration of `spec` on `logits[..., n, n]` (no checks, no recompute)."""
    dims = normalisation_dims(spec.sinkhorn_start, spec.sinkhorn_order, iterations)
    if spec.sinkhorn_start == "exp":
        # exp(Z) normalised in the log domain (unguarded: `VariantSpec` requires it).
        log_m = logits
        for dim in dims:
            log_m = log_m - torch.logsumexp(log_m, dim=dim, keepdim=True)
        return torch.exp(log_m)
    if spec.sinkhorn_start == "exp_rowmax":
        # The rowmax is a per-row constant that a first row step cancels, so it is then detached, as upstream's
        # backward does; a column step first keeps it in the result, and in the gradient.
        rowmax = logits.amax(dim=-1, keepdim=True)
        m = torch.exp(logits - (rowmax.detach() if dims[0] == -1 else rowmax))
    else:  # softmax_eps
        m = torch.softmax(logits, dim=-1) + eps
    for dim in dims:
        m = _normalise(m, dim, spec.sinkhorn_guard, eps)
    return m


class _SinkhornRecompute(torch.autograd.Function):
    """Forward without a graph; backward re-runs the iteration from the saved logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int, eps: float, spec: VariantSpec):
        ctx.iterations, ctx.eps, ctx.spec = iterations, eps, spec
        ctx.save_for_backward(logits)
        with torch.no_grad():
            return sinkhorn_iterate(logits, iterations, eps, spec)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            z = logits.detach().requires_grad_(True)
            out = sinkhorn_iterate(z, ctx.iterations, ctx.eps, ctx.spec)
            (grad,) = torch.autograd.grad(out, z, grad_out)
        return grad, None, None, None


@dataclass(frozen=True, kw_only=True)
class SinkhornCall:
    """A checked `sinkhorn` call, what every backend's `sinkhorn` receives (built by `sinkhorn`)."""

    logits: torch.Tensor
    """`[..., n, n]`, any float dtype."""
    iterations: int
    """>= 1."""
    eps: float
    """The guard's eps, resolved (the variant's when the caller gave None)."""
    spec: VariantSpec


class SinkhornBackend(Protocol):
    """A backend's `sinkhorn` (`contract.Backend`)."""

    def sinkhorn(self, call: SinkhornCall) -> torch.Tensor: ...


def sinkhorn_reference(call: SinkhornCall) -> torch.Tensor:
    """The reference backend's `sinkhorn`: scans the logits for NaN / inf, iterates in fp32 at least (fp64 stays
    fp64) and rounds once to `logits.dtype`; under `input_dtype_sinkhorn` in `logits.dtype` itself."""
    check_finite(call.logits, name="logits", op="sinkhorn")
    compute = (
        call.logits.dtype
        if call.spec.sinkhorn_in_input_dtype
        else torch.promote_types(call.logits.dtype, torch.float32)
    )
    out = _SinkhornRecompute.apply(call.logits.to(compute), call.iterations, call.eps, call.spec)
    return out.to(call.logits.dtype)


def sinkhorn(
    logits: torch.Tensor,
    iterations: int = 20,
    eps: float | None = None,
    variant: str | Variant | VariantSpec = Variant.MEGATRON_MAIN,
    *,
    backend: SinkhornBackend | None = None,
) -> torch.Tensor:
    """Project `logits[..., n, n]` onto (approximately) doubly stochastic matrices `[..., n, n]`.

    Args:
        logits: `[..., n, n]`, any float dtype; the math runs in fp32 at least (fp64 stays fp64)
            and the result is cast back to `logits.dtype`.
        iterations: number of Sinkhorn iterations, >= 1.
        eps: guard of the variant; None takes the variant's (1e-6 for both Megatron variants).
        variant: `paper`, `megatron_main` or `megatron_dev`.
        backend: the backend that computes it (`mhc_core.kernels`); None: the reference.

    Returns:
        `[..., n, n]` with non-negative entries; which sums are exact is `get_variant(v).exact_sums`.
    """
    spec = get_variant(variant)
    iterations, eps_ = check_sinkhorn_args(logits, iterations, eps, spec, op="sinkhorn")
    call = SinkhornCall(logits=logits, iterations=iterations, eps=eps_, spec=spec)
    return sinkhorn_reference(call) if backend is None else backend.sinkhorn(call)
