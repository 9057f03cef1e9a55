"""cuTile Sinkhorn-Knopp kernels, forward and backward, for the three variants.

One block handles `TILE_B` matrices `[TILE_B, n, n]` held in registers, in fp32.

Every variant is "a start map, then `P` pairs of normalisations":

| variant (`VARIANT`) | start `S0` | pair | `P` |
|---|---|---|---|
| `paper` (0) | `L = Z` (log domain) | column then row `L -= logsumexp(L)` | `iterations` |
| `megatron_main` (1) | `exp(Z - rowmax)` | row then column, `/ max(sum, eps)` | `iterations` |
| `megatron_dev` (2) | `softmax(Z) + eps`, then a column step `/ (sum + eps)` | row then column, `/ (sum + eps)` | `iterations - 1` |

The backward kernel gets only the logits (what the autograd function saves). It replays the
forward once, storing the input of every pair into a global workspace `work [P, B, n, n]` (fp32,
10.5 MB at B = 8192, n = 4, P = 20; it stays in L2), then walks the pairs backwards applying the
two step VJPs to each stored state: `2P` pair evaluations.

Step VJPs (`y = x / d`, `d = guard(sum_a x)`): `g_x = (g - sum_a(g * y) * [guard passes]) / d`,
where the clamp guard passes where `sum >= eps` (torch's `clamp_min` gradient). Log-domain step
`L' = L - logsumexp_a(L)`: `g_L = g - exp(L') * sum_a(g)`.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.sinkhorn_common import DEV, MAIN, PAPER, num_pairs

ConstInt = ct.Constant[int]
PAD_ZERO = ct.PaddingMode.ZERO

ROW, COL = 2, 1
"""Reduction axes of a row / column normalisation in a `[TILE_B, n, n]` tile."""


def _load(arr, pid, N, TILE_B):
    """Block `pid` of `arr [B, n, n]` as fp32 `[TILE_B, n, n]`."""
    return ct.astype(ct.load(arr, index=(pid, 0, 0), shape=(TILE_B, N, N), padding_mode=PAD_ZERO), ct.float32)


def _store(arr, pid, tile):
    ct.store(arr, index=(pid, 0, 0), tile=ct.astype(tile, arr.dtype))


def _lse(x, axis):
    mx = ct.max(x, axis=axis, keepdims=True)
    return mx + ct.log(ct.sum(ct.exp(x - mx), axis=axis, keepdims=True))


def _norm_div(x, axis, eps, VARIANT):
    """Divisor of one normalisation step of the linear-domain variants."""
    s = ct.sum(x, axis=axis, keepdims=True)
    if VARIANT == MAIN:
        d = ct.maximum(s, eps)
    else:
        d = s + eps
    return d


def _norm(x, axis, eps, VARIANT):
    if VARIANT == PAPER:
        y = x - _lse(x, axis)
    else:
        y = x / _norm_div(x, axis, eps, VARIANT)
    return y


def _norm_vjp(x, g, axis, eps, VARIANT):
    """Gradient w.r.t. the input `x` of one step, given the gradient `g` of its output."""
    if VARIANT == PAPER:
        y = x - _lse(x, axis)
        gx = g - ct.exp(y) * ct.sum(g, axis=axis, keepdims=True)
    else:
        s = ct.sum(x, axis=axis, keepdims=True)
        if VARIANT == MAIN:
            d = ct.maximum(s, eps)
            y = x / d
            c = ct.sum(g * y, axis=axis, keepdims=True)
            c = ct.where(s >= eps, c, 0.0)
        else:
            d = s + eps
            y = x / d
            c = ct.sum(g * y, axis=axis, keepdims=True)
        gx = (g - c) / d
    return gx


def _first_axis(VARIANT):
    if VARIANT == PAPER:
        a = COL
    else:
        a = ROW
    return a


def _second_axis(VARIANT):
    if VARIANT == PAPER:
        a = ROW
    else:
        a = COL
    return a


def _softmax_rows(z):
    e = ct.exp(z - ct.max(z, axis=ROW, keepdims=True))
    return e / ct.sum(e, axis=ROW, keepdims=True)


def _start(z, eps, VARIANT):
    if VARIANT == PAPER:
        s = z
    elif VARIANT == MAIN:
        s = ct.exp(z - ct.max(z, axis=ROW, keepdims=True))
    else:
        s = _norm(_softmax_rows(z) + eps, COL, eps, VARIANT)
    return s


def _pair(s, eps, VARIANT):
    s = _norm(s, _first_axis(VARIANT), eps, VARIANT)
    return _norm(s, _second_axis(VARIANT), eps, VARIANT)


@ct.kernel
def sinkhorn_fwd_kernel(logits, out, iterations: int, eps: float,
                        N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = _start(_load(logits, pid, N, TILE_B), eps, VARIANT)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = _pair(s, eps, VARIANT)
    if VARIANT == PAPER:
        s = ct.exp(s)
    _store(out, pid, s)


@ct.kernel
def sinkhorn_bwd_kernel(logits, grad_out, grad_logits, work, iterations: int, eps: float,
                        N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`; `work [max(P, 1), B, n, n]` fp32 scratch."""
    pid = ct.bid(0)
    z = _load(logits, pid, N, TILE_B)
    g = _load(grad_out, pid, N, TILE_B)
    pairs = num_pairs(iterations, VARIANT)
    st = _start(z, eps, VARIANT)
    for q in range(pairs):
        ct.store(work, index=(q, pid, 0, 0), tile=ct.reshape(st, (1, TILE_B, N, N)))
        st = _pair(st, eps, VARIANT)
    if VARIANT == PAPER:
        # out = exp(L_P): the gradient enters the log domain through the output.
        g = g * ct.exp(st)
    for qq in range(pairs):
        q = pairs - 1 - qq
        prev = ct.reshape(ct.load(work, index=(q, pid, 0, 0), shape=(1, TILE_B, N, N), padding_mode=PAD_ZERO),
                          (TILE_B, N, N))
        mid = _norm(prev, _first_axis(VARIANT), eps, VARIANT)
        g = _norm_vjp(mid, g, _second_axis(VARIANT), eps, VARIANT)
        g = _norm_vjp(prev, g, _first_axis(VARIANT), eps, VARIANT)
    if VARIANT == MAIN:
        # exp(Z - rowmax), rowmax treated as a constant (the first row step cancels it).
        g = g * ct.exp(z - ct.max(z, axis=ROW, keepdims=True))
    elif VARIANT == DEV:
        p = _softmax_rows(z)
        g = _norm_vjp(p + eps, g, COL, eps, VARIANT)
        g = p * (g - ct.sum(g * p, axis=ROW, keepdims=True))
    _store(grad_logits, pid, g)
