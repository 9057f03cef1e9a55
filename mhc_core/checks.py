"""Argument checks shared by the ops: every failure is a `ValueError` naming the argument."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

__all__ = [
    "NonFiniteError",
    "check_rank",
    "check_dim",
    "check_streams",
    "check_finite",
    "check_floating",
    "check_int",
    "check_number",
    "shape_str",
    "as_int",
]


class NonFiniteError(ValueError):
    """A tensor holds NaN or inf (`check_finite`)."""


def shape_str(t: torch.Tensor) -> str:
    """`[2, 4, 8]` for a tensor of that shape."""
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def as_int(value: object) -> int | None:
    """`value` as a Python int if it is an integer (`int`, a NumPy integer, any `numbers.Integral`) and
    not a bool; else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def check_streams(n: object, *, op: str) -> int:
    """`n`, an integer >= 1 (NumPy integers too), as a Python int."""
    v = as_int(n)
    if v is None or v < 1:
        raise ValueError(f"{op}: n={n!r} must be an integer >= 1 (number of residual streams)")
    return v


def check_rank(t: torch.Tensor, rank: int, *, name: str, op: str, layout: str) -> None:
    """`t` is a tensor of exactly `rank` dims (`layout` describes them, e.g. `[T, n, C]`)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{op}: {name} must have shape {layout} ({rank} dims), got {shape_str(t)}")


def check_dim(t: torch.Tensor, dims: Sequence[int | None], *, name: str, op: str, layout: str) -> None:
    """`t.shape` equals `dims` where an entry is not None."""
    check_rank(t, len(dims), name=name, op=op, layout=layout)
    for got, want in zip(t.shape, dims, strict=True):
        if want is not None and got != want:
            expected = "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"
            raise ValueError(f"{op}: {name} must have shape {layout} = {expected}, got {shape_str(t)}")


def check_floating(*, op: str, **tensors: torch.Tensor | None) -> None:
    """Each tensor (None skipped) has a floating dtype: an integer one would be truncated or refused deep inside."""
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise ValueError(
                f"{op}: {name} must be a floating tensor (bf16, fp16, fp32, fp64), got dtype {t.dtype}"
            )


def check_int(value: object, *, name: str, op: str, low: int = 1) -> int:
    """`value` as a Python int: an integer (NumPy integers too; not a bool) >= `low`; else `ValueError`
    naming it."""
    v = as_int(value)
    if v is None or v < low:
        raise ValueError(f"{op}: {name}={value!r} must be an integer >= {low}")
    return v


def check_number(
    value: object,
    *,
    name: str,
    op: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = True,
) -> float:
    """`value` as a float: a real number (not a bool or a string) in the interval; `ValueError` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{op}: {name}={value!r} must be a finite number")
    v = float(value)
    if v < low or (low_open and v == low) or v > high or (high_open and v == high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{op}: {name}={value!r} must be in {interval}")
    return v


def check_finite(t: torch.Tensor, *, name: str, op: str) -> None:
    """No NaN or inf in `t` (a host sync: the reference ops are the oracle, not the fast path).
    Skipped for a CUDA tensor while its stream is being captured into a CUDA graph, where a host
    sync is not allowed: replays of that graph do not scan (uncaptured calls do)."""
    if t.numel() == 0 or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = ~torch.isfinite(t.detach())
    if bool(bad.any()):
        count = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise NonFiniteError(
            f"{op}: {name} of shape {shape_str(t)} holds {count} non-finite value(s) (NaN/inf), "
            f"first at index {first}: {t.detach()[first].item()}"
        )
