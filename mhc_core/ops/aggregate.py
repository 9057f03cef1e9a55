"""Stream aggregation: `h_aggregate(x[T, n, C], h_pre[T, n]) -> [T, C]`, `out = sum_i h_pre_i * x_i`.

Products are accumulated in fp32 (fp64 stays fp64) and rounded once to `x.dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mhc_core.checks import check_dim, check_floating, check_rank, check_streams

__all__ = [
    "AggregateBackend",
    "AggregateCall",
    "h_aggregate",
    "h_aggregate_reference",
    "check_h_aggregate_args",
]


def check_h_aggregate_args(x, h_pre, *, op: str = "h_aggregate") -> tuple[int, int]:
    """The argument checks of `h_aggregate`, shared by every backend; returns `(T, n)`.

    `x` must be `[T, n, C]` and `h_pre` `[T, n]`; a `ValueError` names the argument.
    """
    check_rank(x, 3, name="x", op=op, layout="[T, n, C]")
    t, n, _ = x.shape
    check_streams(n, op=op)
    check_dim(h_pre, (t, n), name="h_pre", op=op, layout="[T, n]")
    check_floating(op=op, x=x, h_pre=h_pre)
    return t, n


@dataclass(frozen=True, kw_only=True)
class AggregateCall:
    """A checked `h_aggregate` call, what every backend's `h_aggregate` receives (built by `h_aggregate`)."""

    x: torch.Tensor
    """`[T, n, C]`."""
    h_pre: torch.Tensor
    """`[T, n]`."""


class AggregateBackend(Protocol):
    """A backend's `h_aggregate` (`contract.Backend`)."""

    def h_aggregate(self, call: AggregateCall) -> torch.Tensor: ...


def h_aggregate_reference(call: AggregateCall) -> torch.Tensor:
    """The reference backend's `h_aggregate`: fp32 accumulation at least, one rounding to `x.dtype`."""
    x, h_pre = call.x, call.h_pre
    acc = torch.promote_types(torch.promote_types(x.dtype, h_pre.dtype), torch.float32)
    out = torch.einsum("tn,tnc->tc", h_pre.to(acc), x.to(acc))
    return out.to(x.dtype)


def h_aggregate(
    x: torch.Tensor, h_pre: torch.Tensor, *, backend: AggregateBackend | None = None
) -> torch.Tensor:
    """Weighted sum of the `n` streams.

    Args:
        x: `[T, n, C]`.
        h_pre: `[T, n]`.
        backend: the backend that computes it (`mhc_core.kernels`); None: the reference.

    Returns:
        `[T, C]` in `x.dtype`.
    """
    check_h_aggregate_args(x, h_pre, op="h_aggregate")
    call = AggregateCall(x=x, h_pre=h_pre)
    return h_aggregate_reference(call) if backend is None else backend.h_aggregate(call)
