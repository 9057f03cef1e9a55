"""cuTile Sinkhorn-Knopp kernels, forward and backward, for the three variants, in two formulations.

`sinkhorn_fwd_kernel` / `sinkhorn_bwd_kernel`: one block handles `TILE_B` matrices `[TILE_B, n, n]`
held in registers, in fp32. `sinkhorn_fwd_elem_kernel` / `sinkhorn_bwd_elem_kernel` (below, with their
`_e_` helpers; `SinkhornTiles.per_element`): the same matrices as a tuple of `n*n` tiles `[TILE_B]`.

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

from mhc_core.kernels.cutile.constants import DEV, MAIN, PAPER, num_pairs

ConstInt = ct.Constant[int]
PAD_ZERO = ct.PaddingMode.ZERO
F32 = ct.float32

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
def sinkhorn_fwd_kernel(
    logits, out, iterations: int, eps: float, N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt
):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = _start(_load(logits, pid, N, TILE_B), eps, VARIANT)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = _pair(s, eps, VARIANT)
    if VARIANT == PAPER:
        s = ct.exp(s)
    _store(out, pid, s)


@ct.kernel
def sinkhorn_bwd_kernel(
    logits,
    grad_out,
    grad_logits,
    work,
    iterations: int,
    eps: float,
    N: ConstInt,
    TILE_B: ConstInt,
    VARIANT: ConstInt,
):
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
        prev = ct.reshape(
            ct.load(work, index=(q, pid, 0, 0), shape=(1, TILE_B, N, N), padding_mode=PAD_ZERO),
            (TILE_B, N, N),
        )
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


# --- per element (`SinkhornTiles.per_element`) ---------------------------------------------------------------
#
# Same math and variants as the kernels above, with the block's `TILE_B` matrices held
# as a tuple of `n*n` tiles of shape `[TILE_B]`, one per matrix element, row-major (`e[i*n + j]`).
# Every row or column sum is then a chain of adds of whole tiles that share one layout: no reduction
# across a tile axis, so no lane shuffles or shared-memory round trips per step (the `[TILE_B, n, n]`
# kernels compile to 32-48 shuffles per step loop on sm_90; this one to none:
# `python -m tools.cutile.resources --match sinkhorn`). The tuple is built with static loops over
# `n`, so each `n` compiles its own unrolled code. Divisions are fp32 `div.approx`
# (`_e_div`).
#
# Loads read the whole `[TILE_B, n, n]` tile once and split it; stores write one `[TILE_B]` column
# per element. The backward keeps no workspace: it replays pair `q`'s input from the logits for
# every `q`, `P (P + 1) / 2` pair evaluations on registers.
#
# The math on such tuples: the start map, normalisation pairs and their vector-Jacobian products, each
# row or column sum a chain of adds of whole tiles (no reduction across a tile axis). Helpers carry the
# `_e_` prefix, the group axes are `E_ROW` / `E_COL`.

E_ROW, E_COL = 0, 1  # an E_ROW group is row i (members j), an E_COL group is column j (members i)


def _e_idx(axis, g, k, N):
    """Flat index of member `k` of group `g`."""
    if axis == E_ROW:
        r = g * N + k
    else:
        r = k * N + g
    return r


def _e_grp(idx, axis, N):
    """Group of flat index `idx`."""
    if axis == E_ROW:
        r = idx // N
    else:
        r = idx % N
    return r


def _e_fold(e, axis, N, MAX):
    """Per group, the sum (`MAX` false) or the maximum of its members: a chain over whole tiles."""
    out = ()
    for g in ct.static_iter(range(N)):
        r = e[_e_idx(axis, g, 0, N)]
        for k in ct.static_iter(range(1, N)):
            if MAX:
                r = ct.maximum(r, e[_e_idx(axis, g, k, N)])
            else:
                r = r + e[_e_idx(axis, g, k, N)]
        out = out + (r,)
    return out


def _e_sums(e, axis, N):
    return _e_fold(e, axis, N, False)


def _e_maxes(e, axis, N):
    return _e_fold(e, axis, N, True)


def _e_mul(a, b, N):
    """The element-wise product of two tuples of `n*n` tiles."""
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (a[idx] * b[idx],)
    return out


def _e_lse(e, axis, N):
    m = _e_maxes(e, axis, N)
    ex = ()
    for idx in ct.static_iter(range(N * N)):
        ex = ex + (ct.exp(e[idx] - m[_e_grp(idx, axis, N)]),)
    s = _e_sums(ex, axis, N)
    out = ()
    for g in ct.static_iter(range(N)):
        out = out + (m[g] + ct.log(s[g]),)
    return out


def _e_div(x, d):
    """fp32 `div.approx` (<= 2 ulp): a reciprocal and a multiply, where sm_90 compiles the IEEE division
    to a reciprocal, four FMAs, a range check and a slow-path call (32 per normalisation pair here)."""
    return ct.truediv(x, d, rounding_mode=ct.RoundingMode.APPROX)


def _e_divisors(e, axis, eps, VARIANT, N):
    """Group sums and the step's divisors (`max(sum, eps)` for main, `sum + eps` for dev)."""
    s = _e_sums(e, axis, N)
    d = ()
    for g in ct.static_iter(range(N)):
        if VARIANT == MAIN:
            d = d + (ct.maximum(s[g], eps),)
        else:
            d = d + (s[g] + eps,)
    return s, d


def _e_scaled(e, d, axis, N):
    """`e / d` per group: the output of a normalisation with divisors `d`."""
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (_e_div(e[idx], d[_e_grp(idx, axis, N)]),)
    return out


def _e_norm(e, axis, eps, VARIANT, N):
    if VARIANT == PAPER:
        lse = _e_lse(e, axis, N)
        out = ()
        for idx in ct.static_iter(range(N * N)):
            out = out + (e[idx] - lse[_e_grp(idx, axis, N)],)
    else:
        _, d = _e_divisors(e, axis, eps, VARIANT, N)
        out = _e_scaled(e, d, axis, N)
    return out


def _e_vjp_from_output(y, s, d, gr, axis, eps, VARIANT, N):
    """Gradient w.r.t. the input of a (non-paper) normalisation `y = x / d` (`s` the raw sums,
    `d` the divisors), given its output `y` and the gradient `gr` of `y`:
    `(gr - sum_group(gr * y)) / d`, the sum term dropped where `max(s, eps)` clamped (main)."""
    c = ()
    for g in ct.static_iter(range(N)):
        acc = gr[_e_idx(axis, g, 0, N)] * y[_e_idx(axis, g, 0, N)]
        for k in ct.static_iter(range(1, N)):
            acc = acc + gr[_e_idx(axis, g, k, N)] * y[_e_idx(axis, g, k, N)]
        if VARIANT == MAIN:
            acc = ct.where(s[g] >= eps, acc, 0.0)  # clamp_min's gradient: none where it clamped
        c = c + (acc,)
    out = ()
    for idx in ct.static_iter(range(N * N)):
        grp = _e_grp(idx, axis, N)
        out = out + (_e_div(gr[idx] - c[grp], d[grp]),)
    return out


def _e_norm_vjp(x, gr, axis, eps, VARIANT, N):
    """Gradient w.r.t. the step's input `x`, given the gradient `gr` of its output."""
    out = ()
    if VARIANT == PAPER:
        lse = _e_lse(x, axis, N)
        gs = _e_sums(gr, axis, N)
        for idx in ct.static_iter(range(N * N)):
            grp = _e_grp(idx, axis, N)
            out = out + (gr[idx] - ct.exp(x[idx] - lse[grp]) * gs[grp],)
    else:
        s, d = _e_divisors(x, axis, eps, VARIANT, N)
        out = _e_vjp_from_output(_e_scaled(x, d, axis, N), s, d, gr, axis, eps, VARIANT, N)
    return out


def _e_first_axis(VARIANT):
    if VARIANT == PAPER:
        a = E_COL
    else:
        a = E_ROW
    return a


def _e_second_axis(VARIANT):
    if VARIANT == PAPER:
        a = E_ROW
    else:
        a = E_COL
    return a


def _e_softmax_rows(z, N):
    ex = _e_exp_rows_shifted(z, N)
    return _e_scaled(ex, _e_sums(ex, E_ROW, N), E_ROW, N)


def _e_shift(e, c, N):
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (e[idx] + c,)
    return out


def _e_exp_rows_shifted(z, N):
    """`exp(Z - rowmax)`: the `megatron_main` start map."""
    m = _e_maxes(z, E_ROW, N)
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (ct.exp(z[idx] - m[idx // N]),)
    return out


def _e_start(z, eps, VARIANT, N):
    if VARIANT == PAPER:
        s = z
    elif VARIANT == MAIN:
        s = _e_exp_rows_shifted(z, N)
    else:
        s = _e_norm(_e_shift(_e_softmax_rows(z, N), eps, N), E_COL, eps, VARIANT, N)
    return s


def _e_pair(s, eps, VARIANT, N):
    s = _e_norm(s, _e_first_axis(VARIANT), eps, VARIANT, N)
    return _e_norm(s, _e_second_axis(VARIANT), eps, VARIANT, N)


def _e_load_elems(arr, pid, N, TILE_B):
    """Block `pid` of `arr [B, n, n]` as `n*n` fp32 tiles `[TILE_B]`."""
    t = ct.astype(ct.load(arr, index=(pid, 0, 0), shape=(TILE_B, N, N), padding_mode=PAD_ZERO), F32)
    out = ()
    for i in ct.static_iter(range(N)):
        for j in ct.static_iter(range(N)):
            out = out + (ct.reshape(ct.extract(t, (0, i, j), shape=(TILE_B, 1, 1)), (TILE_B,)),)
    return out


def _e_store_elems(arr, pid, e, N, TILE_B):
    for i in ct.static_iter(range(N)):
        for j in ct.static_iter(range(N)):
            tile = ct.reshape(e[i * N + j], (TILE_B, 1, 1))
            ct.store(arr, index=(pid, i, j), tile=ct.astype(tile, arr.dtype))


def _e_pair_vjp(prev, after, g, eps, VARIANT, N):
    """Gradient w.r.t. a pair's input `prev`, given the gradient `g` of its output `after` (unused for
    `paper`, whose log-domain steps recompute what they need)."""
    if VARIANT == PAPER:
        mid = _e_norm(prev, _e_first_axis(VARIANT), eps, VARIANT, N)
        g = _e_norm_vjp(mid, g, _e_second_axis(VARIANT), eps, VARIANT, N)
        g = _e_norm_vjp(prev, g, _e_first_axis(VARIANT), eps, VARIANT, N)
    else:
        # Each step's output is at hand (`mid`, and `after`), so the VJPs reuse it instead of dividing
        # again: 48 divisions a pair, not 80.
        s1, d1 = _e_divisors(prev, _e_first_axis(VARIANT), eps, VARIANT, N)
        mid = _e_scaled(prev, d1, _e_first_axis(VARIANT), N)
        s2, d2 = _e_divisors(mid, _e_second_axis(VARIANT), eps, VARIANT, N)
        g = _e_vjp_from_output(after, s2, d2, g, _e_second_axis(VARIANT), eps, VARIANT, N)
        g = _e_vjp_from_output(mid, s1, d1, g, _e_first_axis(VARIANT), eps, VARIANT, N)
    return g


def _e_output_map(st, VARIANT, N):
    """The op's output from the last pair's output: `exp` of it for `paper` (log domain), else itself."""
    if VARIANT == PAPER:
        ex = ()
        for idx in ct.static_iter(range(N * N)):
            ex = ex + (ct.exp(st[idx]),)
        st = ex
    return st


def _e_exit_grad(st, g, VARIANT, N):
    """The gradient of the last pair's output from that of the op's output: `paper`'s output is
    `exp(L_P)`, so its gradient enters the log domain as `g * exp(L_P)`; the others pass it through."""
    if VARIANT == PAPER:
        g = _e_mul(g, _e_output_map(st, VARIANT, N), N)
    return g


def _e_start_vjp(z, g, eps, VARIANT, N):
    """Gradient w.r.t. the logits `z`, given the gradient `g` of the start map's output."""
    if VARIANT == MAIN:
        # exp(Z - rowmax), rowmax treated as a constant (the first row step cancels it).
        g = _e_mul(g, _e_exp_rows_shifted(z, N), N)
    elif VARIANT == DEV:
        p = _e_softmax_rows(z, N)
        g = _e_norm_vjp(_e_shift(p, eps, N), g, E_COL, eps, VARIANT, N)
        rs = _e_sums(_e_mul(g, p, N), E_ROW, N)
        gz = ()
        for idx in ct.static_iter(range(N * N)):
            gz = gz + (p[idx] * (g[idx] - rs[idx // N]),)
        g = gz
    return g


@ct.kernel
def sinkhorn_fwd_elem_kernel(
    logits, out, iterations: int, eps: float, N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt
):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = _e_start(_e_load_elems(logits, pid, N, TILE_B), eps, VARIANT, N)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = _e_pair(s, eps, VARIANT, N)
    _e_store_elems(out, pid, _e_output_map(s, VARIANT, N), N, TILE_B)


@ct.kernel
def sinkhorn_bwd_elem_kernel(
    logits,
    grad_out,
    grad_logits,
    iterations: int,
    eps: float,
    N: ConstInt,
    TILE_B: ConstInt,
    VARIANT: ConstInt,
):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    z = _e_load_elems(logits, pid, N, TILE_B)
    pairs = num_pairs(iterations, VARIANT)
    st = _e_start(z, eps, VARIANT, N)
    for _ in range(pairs):
        st = _e_pair(st, eps, VARIANT, N)
    after = st  # the output of the last normalisation (non-paper walk)
    g = _e_exit_grad(st, _e_load_elems(grad_out, pid, N, TILE_B), VARIANT, N)
    for qq in range(pairs):
        q = pairs - 1 - qq
        prev = _e_start(z, eps, VARIANT, N)
        done = 0
        while done < q:  # cuTile 1.7: `range(q)` with an outer-loop-dependent bound fails
            prev = _e_pair(prev, eps, VARIANT, N)
            done = done + 1
        g = _e_pair_vjp(prev, after, g, eps, VARIANT, N)
        after = prev
    _e_store_elems(grad_logits, pid, _e_start_vjp(z, g, eps, VARIANT, N), N, TILE_B)
