"""Typed tolerances chosen by dtype and kind, and comparisons that print numbers.

Defined once here and used by every parity and numerics test (and by users checking a backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Tolerance", "tolerance", "assert_close", "cosine_similarity", "assert_cosine"]

Kind = Literal["fwd", "bwd", "proj"]


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """`|actual - expected| <= atol + rtol * |expected|`, elementwise."""

    atol: float
    rtol: float

    def __post_init__(self) -> None:
        for field in ("atol", "rtol"):
            v = getattr(self, field)
            if not v >= 0:
                raise ValueError(f"Tolerance.{field}={v!r} must be >= 0")


_TABLE: dict[tuple[torch.dtype, Kind], Tolerance] = {
    (torch.float64, "fwd"): Tolerance(atol=1e-12, rtol=1e-10),
    (torch.float64, "bwd"): Tolerance(atol=1e-10, rtol=1e-8),
    (torch.float32, "fwd"): Tolerance(atol=1e-5, rtol=1e-5),
    (torch.float32, "bwd"): Tolerance(atol=1e-4, rtol=1e-4),
    # Outputs of a long projection (the mapping's K = n*C, up to 32k terms) from two fp32
    # implementations that sum in different orders. Measured on an H200 at K = 4096: cuTile
    # (3xTF32) 6.6e-6 and torch's fp32 matmul 5.3e-6 max abs error against fp64, on logits up to
    # ~5; at K = 8192 the two differ by up to 2.3e-5.
    (torch.float32, "proj"): Tolerance(atol=5e-5, rtol=1e-5),
    # bf16 / fp16: the tolerances upstream's fused-kernel tests use (FWD 2e-2, BWD 5e-2).
    (torch.bfloat16, "fwd"): Tolerance(atol=2e-2, rtol=2e-2),
    (torch.bfloat16, "bwd"): Tolerance(atol=5e-2, rtol=5e-2),
    (torch.float16, "fwd"): Tolerance(atol=2e-2, rtol=2e-2),
    (torch.float16, "bwd"): Tolerance(atol=5e-2, rtol=5e-2),
}

COSINE_MIN = 0.999
"""Minimum cosine similarity for small coefficient gradients (alphas, bias) in low precision."""


def tolerance(dtype: torch.dtype, kind: Kind = "fwd") -> Tolerance:
    """The tolerance for comparing a `dtype` result of kind `fwd` (outputs), `bwd` (gradients) or
    `proj` (outputs of a long projection: wider than `fwd` in fp32 only)."""
    if kind == "proj" and (dtype, kind) not in _TABLE:
        kind = "fwd"
    try:
        return _TABLE[(dtype, kind)]
    except KeyError:
        raise ValueError(f"tolerance: no entry for dtype={dtype}, kind={kind!r}") from None


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> None:
    """Raise `AssertionError` with max abs error, max rel error and shapes when out of tolerance, or
    when either tensor holds a NaN or an infinity (a non-finite reference proves nothing)."""
    __tracebackhide__ = True
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {list(actual.shape)} != expected {list(expected.shape)}")
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.numel() == 0:
        return
    for label, t in (("actual", a), ("expected", e)):  # NaN compares False: a NaN would pass the bound
        nonfinite = ~torch.isfinite(t)
        if nonfinite.any():
            idx = tuple(int(i) for i in nonfinite.nonzero()[0])
            raise AssertionError(
                f"{name}: {int(nonfinite.sum())} non-finite value(s) in {label}, "
                f"first at {idx}: {float(t[idx])}; shape {list(t.shape)}"
            )
    err = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    bad = err > bound
    if bool(bad.any()):
        rel = err / e.abs().clamp_min(1e-30)
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{a.numel()} elements out of tolerance (atol={tol.atol:g}, "
            f"rtol={tol.rtol:g}); max abs err {float(err.max()):.3e}, max rel err {float(rel.max()):.3e}; "
            f"first at {idx}: actual {float(a[idx]):.8g}, expected {float(e[idx]):.8g}; shape {list(a.shape)}"
        )


def cosine_similarity(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors, in fp64 (1.0 for two zero tensors)."""
    a = actual.detach().to(torch.float64).flatten()
    e = expected.detach().to(torch.float64).flatten()
    na, ne = a.norm(), e.norm()
    if na == 0 and ne == 0:
        return 1.0
    return float((a @ e) / (na * ne).clamp_min(1e-300))


def assert_cosine(
    name: str, actual: torch.Tensor, expected: torch.Tensor, minimum: float = COSINE_MIN
) -> None:
    """Raise `AssertionError` printing the similarity when it is below `minimum`."""
    __tracebackhide__ = True
    cos = cosine_similarity(actual, expected)
    if not cos >= minimum:
        raise AssertionError(
            f"{name}: cosine similarity {cos:.6f} < {minimum}; shapes {list(actual.shape)} vs {list(expected.shape)}"
        )
