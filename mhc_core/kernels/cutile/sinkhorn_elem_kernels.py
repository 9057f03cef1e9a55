"""cuTile Sinkhorn-Knopp kernels, per-element formulation (`SinkhornTiles.per_element`).

Same math, variants and backward schemes as `sinkhorn_kernels` (see there), with the block's
`TILE_B` matrices held as a tuple of `n*n` tiles of shape `[TILE_B]`, one per matrix element,
row-major (`e[i*n + j]`). Every row or column sum is then a chain of adds of whole tiles that share
one layout: no reduction across a tile axis, so no lane shuffles or shared-memory round trips per
step (the `[TILE_B, n, n]` kernels compile to 32-48 shuffles per step loop on sm_90; this one to
none: `python -m mhc_core.kernels.cutile.resources --match sinkhorn`). The tuple is built with
static loops over `n`, so each `n` compiles its own unrolled code.

Loads read the whole `[TILE_B, n, n]` tile once and split it; stores write one `[TILE_B]` column
per element. The backward's trajectory workspace is element-major, `[P, n*n, B]`, so that each of
those columns is contiguous there (a `[P, B, n, n]` workspace made every workspace store and load
a 64-byte-strided scalar access, each 32-byte sector touched `n*n / 2` times). The walk back loads
each pair's input where it is used (not one step ahead: see the walk).

`APPROX` (`SinkhornTiles.approx_div`): every division is fp32 `div.approx` (a reciprocal and a
multiply, <= 2 ulp) instead of the IEEE division, which sm_90 compiles to a reciprocal, four FMAs,
a range check and a slow-path call each: 32 of them per normalisation pair here, the bulk of the
step's instructions (`resources --match sinkhorn`).
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.sinkhorn_common import DEV, MAIN, PAPER, num_pairs

ConstInt = ct.Constant[int]
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


def _sums(e, axis, N):
    out = ()
    for g in ct.static_iter(range(N)):
        s = e[_idx(axis, g, 0, N)]
        for k in ct.static_iter(range(1, N)):
            s = s + e[_idx(axis, g, k, N)]
        out = out + (s,)
    return out


def _maxes(e, axis, N):
    out = ()
    for g in ct.static_iter(range(N)):
        m = e[_idx(axis, g, 0, N)]
        for k in ct.static_iter(range(1, N)):
            m = ct.maximum(m, e[_idx(axis, g, k, N)])
        out = out + (m,)
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


def _div(x, d, APPROX):
    if APPROX:
        r = ct.truediv(x, d, rounding_mode=ct.RoundingMode.APPROX)
    else:
        r = x / d
    return r


def _divisors(e, axis, eps, VARIANT, N):
    """Group sums and the step's divisors (`max(sum, eps)` for main, `sum + eps` for dev)."""
    s = _sums(e, axis, N)
    d = ()
    for g in ct.static_iter(range(N)):
        if VARIANT == MAIN:
            d = d + (ct.maximum(s[g], eps),)
        else:
            d = d + (s[g] + eps,)
    return s, d


def _scaled(e, d, axis, N, APPROX):
    """`e / d` per group: the output of a normalisation with divisors `d`."""
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (_div(e[idx], d[_grp(idx, axis, N)], APPROX),)
    return out


def _norm(e, axis, eps, VARIANT, N, APPROX):
    if VARIANT == PAPER:
        lse = _lse(e, axis, N)
        out = ()
        for idx in ct.static_iter(range(N * N)):
            out = out + (e[idx] - lse[_grp(idx, axis, N)],)
    else:
        _, d = _divisors(e, axis, eps, VARIANT, N)
        out = _scaled(e, d, axis, N, APPROX)
    return out


def _vjp_from_output(y, s, d, gr, axis, eps, VARIANT, N, APPROX):
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
        out = out + (_div(gr[idx] - c[grp], d[grp], APPROX),)
    return out


def _norm_vjp(x, gr, axis, eps, VARIANT, N, APPROX):
    """Gradient w.r.t. the step's input `x`, given the gradient `gr` of its output."""
    out = ()
    if VARIANT == PAPER:
        lse = _lse(x, axis, N)
        gs = _sums(gr, axis, N)
        for idx in ct.static_iter(range(N * N)):
            grp = _grp(idx, axis, N)
            out = out + (gr[idx] - ct.exp(x[idx] - lse[grp]) * gs[grp],)
    else:
        s, d = _divisors(x, axis, eps, VARIANT, N)
        out = _vjp_from_output(_scaled(x, d, axis, N, APPROX), s, d, gr, axis, eps, VARIANT, N, APPROX)
    return out


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


def _softmax_rows(z, N, APPROX):
    m = _maxes(z, ROW, N)
    ex = ()
    for idx in ct.static_iter(range(N * N)):
        ex = ex + (ct.exp(z[idx] - m[idx // N]),)
    s = _sums(ex, ROW, N)
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (_div(ex[idx], s[idx // N], APPROX),)
    return out


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


def _start(z, eps, VARIANT, N, APPROX):
    if VARIANT == PAPER:
        s = z
    elif VARIANT == MAIN:
        s = _exp_rows_shifted(z, N)
    else:
        s = _norm(_shift(_softmax_rows(z, N, APPROX), eps, N), COL, eps, VARIANT, N, APPROX)
    return s


def _pair(s, eps, VARIANT, N, APPROX):
    s = _norm(s, _first_axis(VARIANT), eps, VARIANT, N, APPROX)
    return _norm(s, _second_axis(VARIANT), eps, VARIANT, N, APPROX)



def _load(arr, pid, N, TILE_B):
    """Block `pid` of `arr [B, n, n]` as `n*n` fp32 tiles `[TILE_B]`."""
    t = ct.astype(ct.load(arr, index=(pid, 0, 0), shape=(TILE_B, N, N), padding_mode=PAD_ZERO), F32)
    out = ()
    for i in ct.static_iter(range(N)):
        for j in ct.static_iter(range(N)):
            out = out + (ct.reshape(ct.extract(t, (0, i, j), shape=(TILE_B, 1, 1)), (TILE_B,)),)
    return out


def _store(arr, pid, e, N, TILE_B):
    for i in ct.static_iter(range(N)):
        for j in ct.static_iter(range(N)):
            tile = ct.reshape(e[i * N + j], (TILE_B, 1, 1))
            ct.store(arr, index=(pid, i, j), tile=ct.astype(tile, arr.dtype))


def _store_state(work, q, pid, e, N, TILE_B):
    """Pair input `q` into the element-major workspace `[P, n*n, B]`: each element's `[TILE_B]`
    column is contiguous (one coalesced store per element, not `n*n` strided ones)."""
    for idx in ct.static_iter(range(N * N)):
        ct.store(work, index=(q, idx, pid), tile=ct.reshape(e[idx], (1, 1, TILE_B)))


def _load_state(work, q, pid, N, TILE_B):
    """Pair input `q` as `n*n` tiles `[TILE_B]`: one `[1, n*n, TILE_B]` load, split."""
    t = ct.load(work, index=(q, 0, pid), shape=(1, N * N, TILE_B), padding_mode=PAD_ZERO)
    out = ()
    for idx in ct.static_iter(range(N * N)):
        out = out + (ct.reshape(ct.extract(t, (0, idx, 0), shape=(1, 1, TILE_B)), (TILE_B,)),)
    return out


@ct.kernel
def sinkhorn_fwd_elem_kernel(logits, out, iterations: int, eps: float,
                             N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, APPROX: ConstInt):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = _start(_load(logits, pid, N, TILE_B), eps, VARIANT, N, APPROX)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = _pair(s, eps, VARIANT, N, APPROX)
    if VARIANT == PAPER:
        ex = ()
        for idx in ct.static_iter(range(N * N)):
            ex = ex + (ct.exp(s[idx]),)
        s = ex
    _store(out, pid, s, N, TILE_B)


@ct.kernel
def sinkhorn_bwd_elem_kernel(logits, grad_out, grad_logits, work, iterations: int, eps: float,
                             N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, RECOMPUTE: ConstInt,
                             APPROX: ConstInt):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`; `work [max(P, 1), n*n, B]` fp32
    scratch for the stored trajectory, element-major (untouched with `RECOMPUTE`)."""
    pid = ct.bid(0)
    z = _load(logits, pid, N, TILE_B)
    g = _load(grad_out, pid, N, TILE_B)
    pairs = num_pairs(iterations, VARIANT)
    st = _start(z, eps, VARIANT, N, APPROX)
    for q in range(pairs):
        if RECOMPUTE == 0:
            _store_state(work, q, pid, st, N, TILE_B)
        st = _pair(st, eps, VARIANT, N, APPROX)
    after = st  # the output of the last normalisation (non-paper walk)
    if VARIANT == PAPER:
        # out = exp(L_P): the gradient enters the log domain through the output.
        gl = ()
        for idx in ct.static_iter(range(N * N)):
            gl = gl + (g[idx] * ct.exp(st[idx]),)
        g = gl
    for qq in range(pairs):
        q = pairs - 1 - qq
        if RECOMPUTE:
            prev = _start(z, eps, VARIANT, N, APPROX)
            done = 0
            while done < q:  # cuTile 1.7: `range(q)` with an outer-loop-dependent bound fails
                prev = _pair(prev, eps, VARIANT, N, APPROX)
                done = done + 1
        else:
            # Pair q's input, loaded where it is used. With a one-step-ahead load (`prev = ahead;
            # ahead = load(q - 1)`) next to the carried `after`, the H200 computed wrong gradients
            # for megatron_main / megatron_dev (11-30 parity run), where the CPU interpreter, the
            # paper variant (no `after`) and recompute (no `ahead`) were right. Suspected: tileiras
            # 13.4 and that chain of loop-carried tiles; this form awaits its GPU parity run.
            prev = _load_state(work, q, pid, N, TILE_B)
        if VARIANT == PAPER:
            mid = _norm(prev, _first_axis(VARIANT), eps, VARIANT, N, APPROX)
            g = _norm_vjp(mid, g, _second_axis(VARIANT), eps, VARIANT, N, APPROX)
            g = _norm_vjp(prev, g, _first_axis(VARIANT), eps, VARIANT, N, APPROX)
        else:
            # Each step's output is at hand (`mid`, and `after`: pair q + 1's input, or the final
            # state), so the VJPs reuse it instead of dividing again: 48 divisions a pair, not 80.
            s1, d1 = _divisors(prev, _first_axis(VARIANT), eps, VARIANT, N)
            mid = _scaled(prev, d1, _first_axis(VARIANT), N, APPROX)
            s2, d2 = _divisors(mid, _second_axis(VARIANT), eps, VARIANT, N)
            g = _vjp_from_output(after, s2, d2, g, _second_axis(VARIANT), eps, VARIANT, N, APPROX)
            g = _vjp_from_output(mid, s1, d1, g, _first_axis(VARIANT), eps, VARIANT, N, APPROX)
            after = prev
    if VARIANT == MAIN:
        # exp(Z - rowmax), rowmax treated as a constant (the first row step cancels it).
        s0 = _exp_rows_shifted(z, N)
        gz = ()
        for idx in ct.static_iter(range(N * N)):
            gz = gz + (g[idx] * s0[idx],)
        g = gz
    elif VARIANT == DEV:
        p = _softmax_rows(z, N, APPROX)
        g = _norm_vjp(_shift(p, eps, N), g, COL, eps, VARIANT, N, APPROX)
        gp = ()
        for idx in ct.static_iter(range(N * N)):
            gp = gp + (g[idx] * p[idx],)
        rs = _sums(gp, ROW, N)
        gz = ()
        for idx in ct.static_iter(range(N * N)):
            gz = gz + (p[idx] * (g[idx] - rs[idx // N]),)
        g = gz
    _store(grad_logits, pid, g, N, TILE_B)
