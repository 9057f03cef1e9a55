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
two step VJPs to each stored state: `2P` pair evaluations. With `RECOMPUTE` (a compile-time flag,
the first version's scheme) it keeps no workspace and replays pair `q` from the start for every
`q`, `P (P + 1) / 2` = 210 evaluations: 0.25 ms on an H200 at B = 8192 in the default layout,
against 0.16 ms with the workspace; in the batch-last layout, where a step may be a few
instructions per thread, the recompute may win, which the tile sweep measures.

Layout (`BL`, a compile-time flag): `BL = 0` holds the tile as `[TILE_B, n, n]`, the arrays'
own order; `BL = 1` loads it batch-last, `[n, n, TILE_B]` (a permuted view of the same arrays, no
copy), so that the short matrix axes, which every normalisation reduces over, can stay inside
one thread while the batch spreads over the threads.

Step VJPs (`y = x / d`, `d = guard(sum_a x)`): `g_x = (g - sum_a(g * y) * [guard passes]) / d`,
where the clamp guard passes where `sum >= eps` (torch's `clamp_min` gradient). Log-domain step
`L' = L - logsumexp_a(L)`: `g_L = g - exp(L') * sum_a(g)`.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.sinkhorn_common import DEV, MAIN, PAPER, num_pairs

ConstInt = ct.Constant[int]
PAD_ZERO = ct.PaddingMode.ZERO



def _row(BL):
    """Reduction axis of a row normalisation: 2 in `[B, n, n]`, 1 in `[n, n, B]`."""
    if BL:
        a = 1
    else:
        a = 2
    return a


def _col(BL):
    """Reduction axis of a column normalisation: 1 in `[B, n, n]`, 0 in `[n, n, B]`."""
    if BL:
        a = 0
    else:
        a = 1
    return a


def _load(arr, pid, N, TILE_B, BL):
    """Block `pid` of `arr [B, n, n]` as fp32, in the layout `BL`."""
    if BL:
        t = ct.load(arr, index=(0, 0, pid), shape=(N, N, TILE_B), order=(1, 2, 0), padding_mode=PAD_ZERO)
    else:
        t = ct.load(arr, index=(pid, 0, 0), shape=(TILE_B, N, N), padding_mode=PAD_ZERO)
    return ct.astype(t, ct.float32)


def _store(arr, pid, tile, BL):
    if BL:
        ct.store(arr, index=(0, 0, pid), tile=ct.astype(tile, arr.dtype), order=(1, 2, 0))
    else:
        ct.store(arr, index=(pid, 0, 0), tile=ct.astype(tile, arr.dtype))


def _store_state(work, q, pid, st, N, TILE_B, BL):
    """State `st` into `work [P, B, n, n]` at pair `q`."""
    if BL:
        ct.store(work, index=(q, 0, 0, pid), tile=ct.reshape(st, (1, N, N, TILE_B)), order=(0, 2, 3, 1))
    else:
        ct.store(work, index=(q, pid, 0, 0), tile=ct.reshape(st, (1, TILE_B, N, N)))


def _load_state(work, q, pid, N, TILE_B, BL):
    if BL:
        t = ct.reshape(ct.load(work, index=(q, 0, 0, pid), shape=(1, N, N, TILE_B), order=(0, 2, 3, 1),
                               padding_mode=PAD_ZERO), (N, N, TILE_B))
    else:
        t = ct.reshape(ct.load(work, index=(q, pid, 0, 0), shape=(1, TILE_B, N, N), padding_mode=PAD_ZERO),
                       (TILE_B, N, N))
    return t


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


def _first_axis(VARIANT, BL):
    if VARIANT == PAPER:
        a = _col(BL)
    else:
        a = _row(BL)
    return a


def _second_axis(VARIANT, BL):
    if VARIANT == PAPER:
        a = _row(BL)
    else:
        a = _col(BL)
    return a


def _softmax_rows(z, BL):
    e = ct.exp(z - ct.max(z, axis=_row(BL), keepdims=True))
    return e / ct.sum(e, axis=_row(BL), keepdims=True)


def _start(z, eps, VARIANT, BL):
    if VARIANT == PAPER:
        s = z
    elif VARIANT == MAIN:
        s = ct.exp(z - ct.max(z, axis=_row(BL), keepdims=True))
    else:
        s = _norm(_softmax_rows(z, BL) + eps, _col(BL), eps, VARIANT)
    return s


def _pair(s, eps, VARIANT, BL):
    s = _norm(s, _first_axis(VARIANT, BL), eps, VARIANT)
    return _norm(s, _second_axis(VARIANT, BL), eps, VARIANT)



@ct.kernel
def sinkhorn_fwd_kernel(logits, out, iterations: int, eps: float,
                        N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, BL: ConstInt):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = _start(_load(logits, pid, N, TILE_B, BL), eps, VARIANT, BL)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = _pair(s, eps, VARIANT, BL)
    if VARIANT == PAPER:
        s = ct.exp(s)
    _store(out, pid, s, BL)


@ct.kernel
def sinkhorn_bwd_kernel(logits, grad_out, grad_logits, work, iterations: int, eps: float,
                        N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, BL: ConstInt, RECOMPUTE: ConstInt):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`; `work [max(P, 1), B, n, n]` fp32 scratch.

    `RECOMPUTE`: no workspace (`work` is never touched); pair `q`'s input is replayed from the
    start for every `q`, `P (P + 1) / 2` pair evaluations on registers.
    """
    pid = ct.bid(0)
    z = _load(logits, pid, N, TILE_B, BL)
    g = _load(grad_out, pid, N, TILE_B, BL)
    pairs = num_pairs(iterations, VARIANT)
    st = _start(z, eps, VARIANT, BL)
    for q in range(pairs):
        if RECOMPUTE == 0:
            _store_state(work, q, pid, st, N, TILE_B, BL)
        st = _pair(st, eps, VARIANT, BL)
    if VARIANT == PAPER:
        # out = exp(L_P): the gradient enters the log domain through the output.
        g = g * ct.exp(st)
    for qq in range(pairs):
        q = pairs - 1 - qq
        if RECOMPUTE:
            prev = _start(z, eps, VARIANT, BL)
            # A `while` loop: cuTile 1.7 fails on `range(q)` whose bound depends on an outer loop
            # variable (internal error in bytecode generation).
            done = 0
            while done < q:
                prev = _pair(prev, eps, VARIANT, BL)
                done = done + 1
        else:
            prev = _load_state(work, q, pid, N, TILE_B, BL)
        mid = _norm(prev, _first_axis(VARIANT, BL), eps, VARIANT)
        g = _norm_vjp(mid, g, _second_axis(VARIANT, BL), eps, VARIANT)
        g = _norm_vjp(prev, g, _first_axis(VARIANT, BL), eps, VARIANT)
    if VARIANT == MAIN:
        # exp(Z - rowmax), rowmax treated as a constant (the first row step cancels it).
        g = g * ct.exp(z - ct.max(z, axis=_row(BL), keepdims=True))
    elif VARIANT == DEV:
        p = _softmax_rows(z, BL)
        g = _norm_vjp(p + eps, g, _col(BL), eps, VARIANT)
        g = p * (g - ct.sum(g * p, axis=_row(BL), keepdims=True))
    _store(grad_logits, pid, g, BL)
