"""The per-element Sinkhorn kernels' math (a kernel-helper module: imports `cuda.tile`, see
`tools.cutile.emulator.HELPER_MODULES`): a block's `TILE_B` matrices as a tuple of `n*n` fp32 tiles `[TILE_B]`,
one per matrix element, row-major (`e[i*n + j]`), and the start map, normalisation pairs and their
vector-Jacobian products on such tuples. Every row or column sum is a chain of adds of whole tiles
that share one layout (no reduction across a tile axis). The kernels are in `sinkhorn_elem_kernels`.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.sinkhorn_common import DEV, MAIN, PAPER

PAD_ZERO = ct.PaddingMode.ZERO
F32 = ct.float32

ROW, COL = 0, 1  # a ROW group is row i (members j), a COL group is column j (members i)


def _idx(axis, g, k, N):
    """Flat index of member `k` of group `g`."""
    if axis == ROW:
        r = g * N + k
    else:
        r = k * N + g
    return r


def _grp(idx, axis, N):
    """Group of flat index `idx`."""
    if axis == ROW:
        r = idx // N
    else:
        r = idx % N
    return r


def _fold(e, axis, N, MAX):
    """Per group, the sum (`MAX` false) or the maximum of its members: a chain over whole tiles."""
    out = ()
    for g in ct.static_iter(range(N)):
        r = e[_idx(axis, g, 0, N)]
        for k in ct.static_iter(range(1, N)):
            if MAX:
                r = ct.maximum(r, e[_idx(axis, g, k, N)])
            else:
                r = r + e[_idx(axis, g, k, N)]
        out = out + (r,)
    return out


def _sums(e, axis, N):
    return _fold(e, axis, N, False)


def _maxes(e, axis, N):
    return _fold(e, axis, N, True)


def _mul(a, b, N):
    """The element-wise product of two tuples of `n*n` tiles."""
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (a[idx] * b[idx],)
    return out


def _lse(e, axis, N):
    m = _maxes(e, axis, N)
    ex = ()
    for idx in ct.static_iter(range(N * N)):
        ex = ex + (ct.exp(e[idx] - m[_grp(idx, axis, N)]),)
    s = _sums(ex, axis, N)
    out = ()
    for g in ct.static_iter(range(N)):
        out = out + (m[g] + ct.log(s[g]),)
    return out


def _div(x, d):
    """fp32 `div.approx` (<= 2 ulp): a reciprocal and a multiply, where sm_90 compiles the IEEE division
    to a reciprocal, four FMAs, a range check and a slow-path call (32 per normalisation pair here)."""
    return ct.truediv(x, d, rounding_mode=ct.RoundingMode.APPROX)


def divisors(e, axis, eps, VARIANT, N):
    """Group sums and the step's divisors (`max(sum, eps)` for main, `sum + eps` for dev)."""
    s = _sums(e, axis, N)
    d = ()
    for g in ct.static_iter(range(N)):
        if VARIANT == MAIN:
            d = d + (ct.maximum(s[g], eps),)
        else:
            d = d + (s[g] + eps,)
    return s, d


def scaled(e, d, axis, N):
    """`e / d` per group: the output of a normalisation with divisors `d`."""
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (_div(e[idx], d[_grp(idx, axis, N)]),)
    return out


def norm(e, axis, eps, VARIANT, N):
    if VARIANT == PAPER:
        lse = _lse(e, axis, N)
        out = ()
        for idx in ct.static_iter(range(N * N)):
            out = out + (e[idx] - lse[_grp(idx, axis, N)],)
    else:
        _, d = divisors(e, axis, eps, VARIANT, N)
        out = scaled(e, d, axis, N)
    return out


def vjp_from_output(y, s, d, gr, axis, eps, VARIANT, N):
    """Gradient w.r.t. the input of a (non-paper) normalisation `y = x / d` (`s` the raw sums,
    `d` the divisors), given its output `y` and the gradient `gr` of `y`:
    `(gr - sum_group(gr * y)) / d`, the sum term dropped where `max(s, eps)` clamped (main)."""
    c = ()
    for g in ct.static_iter(range(N)):
        acc = gr[_idx(axis, g, 0, N)] * y[_idx(axis, g, 0, N)]
        for k in ct.static_iter(range(1, N)):
            acc = acc + gr[_idx(axis, g, k, N)] * y[_idx(axis, g, k, N)]
        if VARIANT == MAIN:
            acc = ct.where(s[g] >= eps, acc, 0.0)  # clamp_min's gradient: none where it clamped
        c = c + (acc,)
    out = ()
    for idx in ct.static_iter(range(N * N)):
        grp = _grp(idx, axis, N)
        out = out + (_div(gr[idx] - c[grp], d[grp]),)
    return out


def norm_vjp(x, gr, axis, eps, VARIANT, N):
    """Gradient w.r.t. the step's input `x`, given the gradient `gr` of its output."""
    out = ()
    if VARIANT == PAPER:
        lse = _lse(x, axis, N)
        gs = _sums(gr, axis, N)
        for idx in ct.static_iter(range(N * N)):
            grp = _grp(idx, axis, N)
            out = out + (gr[idx] - ct.exp(x[idx] - lse[grp]) * gs[grp],)
    else:
        s, d = divisors(x, axis, eps, VARIANT, N)
        out = vjp_from_output(scaled(x, d, axis, N), s, d, gr, axis, eps, VARIANT, N)
    return out


def first_axis(VARIANT):
    if VARIANT == PAPER:
        a = COL
    else:
        a = ROW
    return a


def second_axis(VARIANT):
    if VARIANT == PAPER:
        a = ROW
    else:
        a = COL
    return a


def _softmax_rows(z, N):
    ex = _exp_rows_shifted(z, N)
    return scaled(ex, _sums(ex, ROW, N), ROW, N)


def _shift(e, c, N):
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (e[idx] + c,)
    return out


def _exp_rows_shifted(z, N):
    """`exp(Z - rowmax)`: the `megatron_main` start map."""
    m = _maxes(z, ROW, N)
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (ct.exp(z[idx] - m[idx // N]),)
    return out


def start(z, eps, VARIANT, N):
    if VARIANT == PAPER:
        s = z
    elif VARIANT == MAIN:
        s = _exp_rows_shifted(z, N)
    else:
        s = norm(_shift(_softmax_rows(z, N), eps, N), COL, eps, VARIANT, N)
    return s


def pair(s, eps, VARIANT, N):
    s = norm(s, first_axis(VARIANT), eps, VARIANT, N)
    return norm(s, second_axis(VARIANT), eps, VARIANT, N)



def load_elems(arr, pid, N, TILE_B):
    """Block `pid` of `arr [B, n, n]` as `n*n` fp32 tiles `[TILE_B]`."""
    t = ct.astype(ct.load(arr, index=(pid, 0, 0), shape=(TILE_B, N, N), padding_mode=PAD_ZERO), F32)
    out = ()
    for i in ct.static_iter(range(N)):
        for j in ct.static_iter(range(N)):
            out = out + (ct.reshape(ct.extract(t, (0, i, j), shape=(TILE_B, 1, 1)), (TILE_B,)),)
    return out


def store_elems(arr, pid, e, N, TILE_B):
    for i in ct.static_iter(range(N)):
        for j in ct.static_iter(range(N)):
            tile = ct.reshape(e[i * N + j], (TILE_B, 1, 1))
            ct.store(arr, index=(pid, i, j), tile=ct.astype(tile, arr.dtype))


def pair_vjp(prev, after, g, eps, VARIANT, N):
    """Gradient w.r.t. a pair's input `prev`, given the gradient `g` of its output `after` (unused for
    `paper`, whose log-domain steps recompute what they need)."""
    if VARIANT == PAPER:
        mid = norm(prev, first_axis(VARIANT), eps, VARIANT, N)
        g = norm_vjp(mid, g, second_axis(VARIANT), eps, VARIANT, N)
        g = norm_vjp(prev, g, first_axis(VARIANT), eps, VARIANT, N)
    else:
        # Each step's output is at hand (`mid`, and `after`), so the VJPs reuse it instead of dividing
        # again: 48 divisions a pair, not 80.
        s1, d1 = divisors(prev, first_axis(VARIANT), eps, VARIANT, N)
        mid = scaled(prev, d1, first_axis(VARIANT), N)
        s2, d2 = divisors(mid, second_axis(VARIANT), eps, VARIANT, N)
        g = vjp_from_output(after, s2, d2, g, second_axis(VARIANT), eps, VARIANT, N)
        g = vjp_from_output(mid, s1, d1, g, first_axis(VARIANT), eps, VARIANT, N)
    return g


def output_map(st, VARIANT, N):
    """The op's output from the last pair's output: `exp` of it for `paper` (log domain), else itself."""
    if VARIANT == PAPER:
        ex = ()
        for idx in ct.static_iter(range(N * N)):
            ex = ex + (ct.exp(st[idx]),)
        st = ex
    return st


def exit_grad(st, g, VARIANT, N):
    """The gradient of the last pair's output from that of the op's output: `paper`'s output is
    `exp(L_P)`, so its gradient enters the log domain as `g * exp(L_P)`; the others pass it through."""
    if VARIANT == PAPER:
        g = _mul(g, output_map(st, VARIANT, N), N)
    return g


def start_vjp(z, g, eps, VARIANT, N):
    """Gradient w.r.t. the logits `z`, given the gradient `g` of the start map's output."""
    if VARIANT == MAIN:
        # exp(Z - rowmax), rowmax treated as a constant (the first row step cancels it).
        g = _mul(g, _exp_rows_shifted(z, N), N)
    elif VARIANT == DEV:
        p = _softmax_rows(z, N)
        g = norm_vjp(_shift(p, eps, N), g, COL, eps, VARIANT, N)
        rs = _sums(_mul(g, p, N), ROW, N)
        gz = ()
        for idx in ct.static_iter(range(N * N)):
            gz = gz + (p[idx] * (g[idx] - rs[idx // N]),)
        g = gz
    return g
