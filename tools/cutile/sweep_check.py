"""Does a sweep candidate compute what the reference does? Relative errors on the same fresh inputs.

`deviation` runs one candidate's op (under the `tiling` override in force) and the reference ops on
the same inputs and returns the largest relative Frobenius error per direction; `check_rtol` is what
a candidate may show before the sweep refuses it (`check: fail`, never a winner).
"""

from __future__ import annotations

import torch

from mhc_core import ops as ref
from tools.cutile.bench import make_inputs, op_call
from tools.cutile.sweep_candidates import directions, op_of

__all__ = ["CHECK_RTOL", "SINKHORN_RTOL", "SMALL_TENSOR", "check_rtol", "deviation", "grade"]

CHECK_RTOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}
"""Largest relative Frobenius error a candidate may show against the reference (per activation
dtype): far above rounding (bf16 outputs: ~1e-3 here), far below a wrong result (~1)."""

SMALL_TENSOR = 16
"""Tensors of fewer values (the `[1]` gains' gradients: sums over every token and coefficient whose
value can cancel to near 0, where any rounding is a large relative error: up to 1.4 on the CPU
interpreter in bf16 at T = 40) must be present and finite but are not compared; the parity tests
hold them to a cosine similarity instead (`mhc_core.testing`)."""

SINKHORN_RTOL = 1e-3
"""`CHECK_RTOL` for Sinkhorn, whatever the activation dtype: its math is fp32 in the kernels and the
reference alike (its logits are bf16 in a bf16 sweep under megatron_main / megatron_dev, whose
coefficients are in the activation dtype, so the two round the same fp32 result). It separates the
right candidates (at most 3.8e-5 on an H200 with bf16 logits, approximate division included) from a
wrong backward (6.9e-3 to 7.6e-3), which the bf16 bound (2e-2) lets through (`docs/measurements/h200-2026-11-30/`)."""


def check_rtol(key: str, act: torch.dtype) -> float:
    """The largest `max_rel_err` a candidate of sweep key `key` may show at activation dtype `act`."""
    return SINKHORN_RTOL if op_of(key) == "sinkhorn" else CHECK_RTOL[act]


def grade(key: str, act: torch.dtype, err: float) -> str:
    """A sweep row's `check`: "ok" when `err` is within `check_rtol(key, act)`, else "fail"."""
    return "ok" if err <= check_rtol(key, act) else "fail"


def _rel_error(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None:
        return float("inf")
    a, b = a.detach().float(), b.detach().float()
    if not torch.isfinite(a).all():
        return float("inf")
    if b.numel() < SMALL_TENSOR:
        return 0.0
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-30))


def deviation(
    ops,
    key: str,
    t: int,
    n: int,
    c: int,
    act: torch.dtype,
    variant: str,
    iterations: int,
    device: str = "cuda",
) -> dict[str, float]:
    """`{direction: relative error}` of `key`'s op with the ops bundle `ops` against the reference
    ops on the same fresh inputs: the largest over the forward outputs, or (backward) over the
    gradients of every input for the same random output gradients (small tensors: `SMALL_TENSOR`)."""
    op = op_of(key)
    fn, ref_fn = op_call(ops, op, n, variant, iterations), op_call(ref, op, n, variant, iterations)
    inputs = [
        x.requires_grad_(True) if x is not None else None
        for x in make_inputs(op, t, n, c, act, variant, device)
    ]
    leaves = [x for x in inputs if x is not None]
    got, want = fn(*inputs), ref_fn(*inputs)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    out: dict[str, float] = {}
    if "fwd" in directions(key):
        out["fwd"] = max(_rel_error(a, b) for a, b in zip(got, want, strict=True))
    if "bwd" in directions(key):
        grads = [torch.randn_like(w) for w in want]
        g_got = torch.autograd.grad(got, leaves, grads, allow_unused=True)
        g_want = torch.autograd.grad(want, leaves, grads, allow_unused=True)
        out["bwd"] = max(_rel_error(a, b) for a, b in zip(g_got, g_want, strict=True) if b is not None)
    return out
