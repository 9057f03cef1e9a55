"""cuTile Sinkhorn-Knopp kernels, per-element formulation (`SinkhornTiles.per_element`).

Same math, variants and backward schemes as `sinkhorn_kernels` (see there), with the block's
`TILE_B` matrices held as a tuple of `n*n` tiles of shape `[TILE_B]`, one per matrix element,
row-major (`e[i*n + j]`). Every row or column sum is then a chain of adds of whole tiles that share
one layout: no reduction across a tile axis, so no lane shuffles or shared-memory round trips per
step (the `[TILE_B, n, n]` kernels compile to 32-48 shuffles per step loop on sm_90; this one to
none: `python -m tools.cutile.resources --match sinkhorn`). The tuple is built with
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

from mhc_core.kernels.cutile.sinkhorn_common import num_pairs
from mhc_core.kernels.cutile.sinkhorn_elem_math import (
    exit_grad,
    load_elems,
    load_state,
    output_map,
    pair,
    pair_vjp,
    start,
    start_vjp,
    store_elems,
    store_state,
)

ConstInt = ct.Constant[int]


@ct.kernel
def sinkhorn_fwd_elem_kernel(logits, out, iterations: int, eps: float,
                             N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, APPROX: ConstInt):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = start(load_elems(logits, pid, N, TILE_B), eps, VARIANT, N, APPROX)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = pair(s, eps, VARIANT, N, APPROX)
    store_elems(out, pid, output_map(s, VARIANT, N), N, TILE_B)


@ct.kernel
def sinkhorn_bwd_elem_kernel(logits, grad_out, grad_logits, work, iterations: int, eps: float,
                             N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, RECOMPUTE: ConstInt,
                             APPROX: ConstInt):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`; `work [max(P, 1), n*n, B]` fp32
    scratch for the stored trajectory, element-major (untouched with `RECOMPUTE`)."""
    pid = ct.bid(0)
    z = load_elems(logits, pid, N, TILE_B)
    pairs = num_pairs(iterations, VARIANT)
    st = start(z, eps, VARIANT, N, APPROX)
    for q in range(pairs):
        if RECOMPUTE == 0:
            store_state(work, q, pid, st, N, TILE_B)
        st = pair(st, eps, VARIANT, N, APPROX)
    after = st  # the output of the last normalisation (non-paper walk)
    g = exit_grad(st, load_elems(grad_out, pid, N, TILE_B), VARIANT, N)
    for qq in range(pairs):
        q = pairs - 1 - qq
        if RECOMPUTE:
            prev = start(z, eps, VARIANT, N, APPROX)
            done = 0
            while done < q:  # cuTile 1.7: `range(q)` with an outer-loop-dependent bound fails
                prev = pair(prev, eps, VARIANT, N, APPROX)
                done = done + 1
        else:
            # Pair q's input, loaded where it is used: a one-step-ahead load (`prev = ahead;
            # ahead = load(q - 1)`) next to the carried `after` computes wrong gradients on an H200
            # for megatron_main / megatron_dev (tileiras 13.4) while the CPU interpreter, the paper
            # variant (no `after`) and recompute (no `ahead`) are right. This form has not had its
            # GPU parity run (docs/cutile.md, "Status").
            prev = load_state(work, q, pid, N, TILE_B)
        g = pair_vjp(prev, after, g, eps, VARIANT, N, APPROX)
        after = prev
    store_elems(grad_logits, pid, start_vjp(z, g, eps, VARIANT, N, APPROX), N, TILE_B)


def _checkpointed_walk(work, pid, z, eps, N, TILE_B, VARIANT, APPROX, PAIRS, STRIDE):
    """The start map and `PAIRS` pairs (unrolled) from the logits `z`, storing every `STRIDE`-th pair
    input to `work` (checkpoint `q // STRIDE`); the last pair's output."""
    st = start(z, eps, VARIANT, N, APPROX)
    for q in ct.static_iter(range(PAIRS)):
        if q % STRIDE == 0:
            store_state(work, q // STRIDE, pid, st, N, TILE_B)
        st = pair(st, eps, VARIANT, N, APPROX)
    return st


@ct.kernel
def sinkhorn_fwd_checkpoint_kernel(logits, out, work, eps: float,
                                   N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, APPROX: ConstInt,
                                   PAIRS: ConstInt, STRIDE: ConstInt):
    """`logits [B, n, n]` -> `out [B, n, n]`, and the checkpoints of `sinkhorn_bwd_checkpoint_kernel`
    (`SAVED`) into `work [cdiv(PAIRS, STRIDE), n*n, B]` fp32 (`SinkhornTiles.fwd_checkpoints`);
    grid `(cdiv(B, TILE_B),)`, `PAIRS >= 1`."""
    pid = ct.bid(0)
    st = _checkpointed_walk(work, pid, load_elems(logits, pid, N, TILE_B), eps, N, TILE_B, VARIANT, APPROX, PAIRS,
                            STRIDE)
    store_elems(out, pid, output_map(st, VARIANT, N), N, TILE_B)


@ct.kernel
def sinkhorn_bwd_checkpoint_kernel(logits, grad_out, grad_logits, work, eps: float,
                                   N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt, APPROX: ConstInt,
                                   PAIRS: ConstInt, STRIDE: ConstInt, SAVED: ConstInt):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`, checkpointed; grid `(cdiv(B, TILE_B),)`;
    `work [cdiv(PAIRS, STRIDE), n*n, B]` fp32, element-major like `sinkhorn_bwd_elem_kernel`'s.

    The pair count `PAIRS` is a compile-time constant, so both walks are unrolled. The forward
    stores every `STRIDE`-th pair input (a checkpoint) to `work`; the walk back, segment by segment
    from the last, loads the segment's checkpoint, replays the segment's other pair inputs from it
    into values of the program (registers) and takes their VJPs in reverse. Pair evaluations:
    `2 * PAIRS - cdiv(PAIRS, STRIDE)` (`RECOMPUTE`: `PAIRS * (PAIRS + 1) / 2`); workspace rows
    `cdiv(PAIRS, STRIDE)` (stored: `PAIRS`); live states at most `STRIDE`. The checkpoints go
    through memory on purpose: a replay from a value still in the program is the forward's own
    computation again, which the compiler merges with it (then all `PAIRS` states stay live and
    spill: sm_90, 20 pairs, 255 registers and a 2.3-3 KB stack per thread).

    `SAVED` (`PAIRS >= 1`): `work` already holds the checkpoints (`sinkhorn_fwd_checkpoint_kernel`),
    so the forward walk is skipped; the last pair's output is the last segment replayed one pair
    further. Pair evaluations then `PAIRS - cdiv(PAIRS, STRIDE) + 1`.
    """
    pid = ct.bid(0)
    z = load_elems(logits, pid, N, TILE_B)
    NN = N * N
    segments = (PAIRS + STRIDE - 1) // STRIDE
    if SAVED:
        st = load_state(work, segments - 1, pid, N, TILE_B)
        for _ in ct.static_iter(range(PAIRS - (segments - 1) * STRIDE)):
            st = pair(st, eps, VARIANT, N, APPROX)
    else:
        st = _checkpointed_walk(work, pid, z, eps, N, TILE_B, VARIANT, APPROX, PAIRS, STRIDE)
    after = st
    g = exit_grad(st, load_elems(grad_out, pid, N, TILE_B), VARIANT, N)
    for kk in ct.static_iter(range(segments)):
        k = segments - 1 - kk
        count = PAIRS - k * STRIDE
        if count > STRIDE:
            count = STRIDE
        prev = load_state(work, k, pid, N, TILE_B)
        seg = ()  # flat: pair (k * STRIDE + i)'s input is seg[i*NN:(i+1)*NN]
        for i in ct.static_iter(range(count)):
            seg = seg + prev
            if i + 1 < count:
                prev = pair(prev, eps, VARIANT, N, APPROX)
        for ii in ct.static_iter(range(count)):
            i = count - 1 - ii
            prev = ()
            for idx in ct.static_iter(range(NN)):
                prev = prev + (seg[i * NN + idx],)
            g = pair_vjp(prev, after, g, eps, VARIANT, N, APPROX)
            after = prev
    store_elems(grad_logits, pid, start_vjp(z, g, eps, VARIANT, N, APPROX), N, TILE_B)
