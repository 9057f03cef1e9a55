"""Stability metric (composite Amax gain), the bytes-moved model of each mHC op and mHC's activation memory.

Legend: T tokens, n streams, C hidden size, N = n*n + 2n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mhc_core.checks import check_rank, shape_str

__all__ = [
    "AmaxGain",
    "amax_gain",
    "OpBytes",
    "bytes_moved",
    "layer_extra_bytes",
    "activation_extra_bytes",
    "OPS",
]


@dataclass(frozen=True, kw_only=True)
class AmaxGain:
    """The paper's "Amax Gain Magnitude" of a composite residual mapping."""

    forward: float
    """max over tokens of the max absolute row sum of `prod H` (signal gain)."""
    backward: float
    """max over tokens of the max absolute column sum (gradient gain)."""


def amax_gain(h_res_stack: torch.Tensor, transposed: bool = False) -> AmaxGain:
    """Composite gain of a stack of per-sublayer residual mappings.

    Args:
        h_res_stack: `[L, T, n, n]` (or `[L, n, n]`), sublayer 0 applied first. The composite is
            `H_{L-1} @ ... @ H_0` per token (`x_{l+1} = H_l x_l`).
        transposed: the stack holds matrices applied transposed (`megatron_dev`'s `H^T @ x`).

    Returns:
        `AmaxGain(forward=..., backward=...)`, each the maximum over tokens.
    """
    if h_res_stack.dim() == 3:
        h_res_stack = h_res_stack.unsqueeze(1)
    check_rank(h_res_stack, 4, name="h_res_stack", op="amax_gain", layout="[L, T, n, n]")
    if h_res_stack.shape[-1] != h_res_stack.shape[-2] or h_res_stack.shape[0] == 0:
        raise ValueError(f"amax_gain: h_res_stack must be [L>=1, T, n, n], got {shape_str(h_res_stack)}")
    mats = h_res_stack.to(torch.float64)
    if transposed:
        mats = mats.transpose(-1, -2)
    composite = mats[0]
    for h in mats[1:]:
        composite = h @ composite
    absm = composite.abs()
    fwd = absm.sum(dim=-1).amax(dim=-1)  # [T]
    bwd = absm.sum(dim=-2).amax(dim=-1)
    return AmaxGain(forward=float(fwd.max()), backward=float(bwd.max()))


OPS = ("sinkhorn", "mapping", "h_aggregate", "h_post_bda", "pre", "single_pass_pre", "residual_add")
Direction = Literal["fwd", "bwd"]


@dataclass(frozen=True, kw_only=True)
class OpBytes:
    """Bytes read and written by an ideal kernel (each tensor touched once)."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written


def bytes_moved(
    op: str,
    direction: Direction,
    *,
    tokens: int,
    n: int,
    hidden: int,
    act_bytes: int,
    coeff_bytes: int = 4,
    with_bias: bool = False,
) -> OpBytes:
    """Bytes-moved model of `op` in `direction` for T=`tokens`, n, C=`hidden`.

    Activations take `act_bytes` per element (2 for bf16), coefficients and parameters
    `coeff_bytes` (4, fp32). `residual_add` is the plain pre-norm residual (2C in, C out) that
    mHC replaces, the reference point of the overhead.
    """
    t, c, a, f = tokens, hidden, act_bytes, coeff_bytes
    big_n = n * n + 2 * n
    nc = n * c
    if op == "sinkhorn":
        if direction == "fwd":
            return OpBytes(read=t * n * n * f, written=t * n * n * f)
        return OpBytes(read=2 * t * n * n * f, written=t * n * n * f)  # logits + grad_out -> grad
    if op == "mapping":
        if direction == "fwd":
            return OpBytes(read=t * nc * a + big_n * nc * f + 3 * f + big_n * f, written=t * big_n * f)
        return OpBytes(
            read=t * nc * a + t * big_n * f + big_n * nc * f,
            written=t * nc * a + big_n * nc * f + 3 * f + big_n * f,
        )
    if op == "h_aggregate":
        if direction == "fwd":
            return OpBytes(read=t * nc * a + t * n * f, written=t * c * a)
        return OpBytes(read=t * c * a + t * nc * a + t * n * f, written=t * nc * a + t * n * f)
    if op == "h_post_bda":
        b = c * a if with_bias else 0
        if direction == "fwd":
            return OpBytes(read=t * nc * a + t * c * a + b + t * (n * n + n) * f, written=t * nc * a)
        return OpBytes(
            read=t * nc * a + t * nc * a + t * c * a + b + t * (n * n + n) * f,
            written=t * nc * a + t * c * a + t * (n * n + n) * f + b,
        )
    if op == "pre":
        # mapping + Sinkhorn + aggregate with x read once: the coefficients and the aggregate out; backward
        # the four output gradients, x and the saved projection and RMS in, one gradient of x out.
        coeffs = t * (2 * n + n * n) * f
        if direction == "fwd":
            return OpBytes(
                read=t * nc * a + big_n * nc * f + 3 * f + big_n * f,
                written=t * c * a + coeffs + t * (big_n + 1) * f,
            )
        return OpBytes(
            read=t * c * a + coeffs + t * nc * a + t * (big_n + 1) * f + big_n * nc * f,
            written=t * nc * a + big_n * nc * f + 3 * f + big_n * f,
        )
    if op == "single_pass_pre":
        # pre's traffic with the aggregate weighted by the previous sublayer's H_pre: that mix [T, n] read too
        # (forward and backward) and its gradient written.
        one = bytes_moved("pre", direction, tokens=t, n=n, hidden=c, act_bytes=a, coeff_bytes=f)
        mix = t * n * f
        return OpBytes(read=one.read + mix, written=one.written + (mix if direction == "bwd" else 0))
    if op == "residual_add":
        if direction == "fwd":
            return OpBytes(read=2 * t * c * a, written=t * c * a)
        return OpBytes(read=t * c * a, written=2 * t * c * a)
    raise ValueError(f"bytes_moved: op={op!r} unknown; valid: {', '.join(OPS)}")


def layer_extra_bytes(*, tokens: int, n: int, hidden: int, act_bytes: int, sublayers: int = 2) -> int:
    """Bytes one transformer layer's forward + backward moves for mHC beyond the plain residual.

    Per sublayer (attention, MLP): `mapping`, `sinkhorn`, `h_aggregate` and `h_post_bda` (no bias:
    the branch output comes bias-free), forward and backward, minus the `residual_add` they replace.
    Divided by the machine's copy bandwidth, this is the floor of mHC's time overhead: what ideal,
    bandwidth-bound kernels would add (`suites/perf/test_layer.py` reports it next to the measured
    overhead). The sublayers (attention, MLP) see the same `[s, b, C]` input as in the plain layer,
    so their own traffic is not part of it.
    """
    kw: dict[str, Any] = dict(tokens=tokens, n=n, hidden=hidden, act_bytes=act_bytes)
    per_sublayer = sum(
        bytes_moved(op, d, **kw).total
        for op in ("mapping", "sinkhorn", "h_aggregate", "h_post_bda")
        for d in ("fwd", "bwd")
    )
    per_sublayer -= sum(bytes_moved("residual_add", d, **kw).total for d in ("fwd", "bwd"))
    return sublayers * per_sublayer


def activation_extra_bytes(
    *, tokens: int, n: int, hidden: int, act_bytes: int, sublayers: int = 2, recompute: bool = False
) -> int:
    """The least activation memory mHC adds to one layer's forward over the plain residual: what its backward
    cannot do without, by sublayer (attention, MLP), in the activation dtype (`act_bytes`) or fp32 (coefficients):

    - the sublayer's input state `[T, n*C]` (the projection's weight gradient, the aggregate's and the mix's
      coefficient gradients read it), unless mHC recompute rebuilds it: then only the group's first state is
      kept, once per layer;
    - the branch output `y [T, C]` (the gradient of `H_post` reads it; a plain residual add keeps nothing);
    - the coefficients `H_pre`, `H_post [T, n]`, `H_res [T, n, n]` and the RMS factor `[T, 1]`, fp32.

    The branch's own input (the aggregate, `[T, C]`) takes the place of the plain layer's and is not counted.
    An implementation keeps at least this (the eager reference keeps Sinkhorn's iterates too:
    `suites/perf/test_activation_memory.py` sets the two side by side)."""
    coefficients = tokens * (2 * n + n * n + 1) * 4
    per_sublayer = tokens * hidden * act_bytes + coefficients
    state = tokens * n * hidden * act_bytes
    states = state if recompute else sublayers * state
    return sublayers * per_sublayer + states
