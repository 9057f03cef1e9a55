"""cuTile Sinkhorn-Knopp kernels, per-element formulation (`SinkhornTiles.per_element`).

Same math and variants as `sinkhorn_kernels` (see there), with the block's `TILE_B` matrices held
as a tuple of `n*n` tiles of shape `[TILE_B]`, one per matrix element, row-major (`e[i*n + j]`).
Every row or column sum is then a chain of adds of whole tiles that share one layout: no reduction
across a tile axis, so no lane shuffles or shared-memory round trips per step (the `[TILE_B, n, n]`
kernels compile to 32-48 shuffles per step loop on sm_90; this one to none:
`python -m tools.cutile.resources --match sinkhorn`). The tuple is built with static loops over
`n`, so each `n` compiles its own unrolled code. Divisions are fp32 `div.approx`
(`sinkhorn_elem_math._div`).

Loads read the whole `[TILE_B, n, n]` tile once and split it; stores write one `[TILE_B]` column
per element. The backward keeps no workspace: it replays pair `q`'s input from the logits for
every `q`, `P (P + 1) / 2` pair evaluations on registers.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.sinkhorn_common import num_pairs
from mhc_core.kernels.cutile.sinkhorn_elem_math import (
    exit_grad,
    load_elems,
    output_map,
    pair,
    pair_vjp,
    start,
    start_vjp,
    store_elems,
)

ConstInt = ct.Constant[int]


@ct.kernel
def sinkhorn_fwd_elem_kernel(logits, out, iterations: int, eps: float,
                             N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt):
    """`logits [B, n, n]` -> `out [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    s = start(load_elems(logits, pid, N, TILE_B), eps, VARIANT, N)
    for _ in range(num_pairs(iterations, VARIANT)):
        s = pair(s, eps, VARIANT, N)
    store_elems(out, pid, output_map(s, VARIANT, N), N, TILE_B)


@ct.kernel
def sinkhorn_bwd_elem_kernel(logits, grad_out, grad_logits, iterations: int, eps: float,
                             N: ConstInt, TILE_B: ConstInt, VARIANT: ConstInt):
    """`logits, grad_out [B, n, n]` -> `grad_logits [B, n, n]`; grid `(cdiv(B, TILE_B),)`."""
    pid = ct.bid(0)
    z = load_elems(logits, pid, N, TILE_B)
    pairs = num_pairs(iterations, VARIANT)
    st = start(z, eps, VARIANT, N)
    for _ in range(pairs):
        st = pair(st, eps, VARIANT, N)
    after = st  # the output of the last normalisation (non-paper walk)
    g = exit_grad(st, load_elems(grad_out, pid, N, TILE_B), VARIANT, N)
    for qq in range(pairs):
        q = pairs - 1 - qq
        prev = start(z, eps, VARIANT, N)
        done = 0
        while done < q:  # cuTile 1.7: `range(q)` with an outer-loop-dependent bound fails
            prev = pair(prev, eps, VARIANT, N)
            done = done + 1
        g = pair_vjp(prev, after, g, eps, VARIANT, N)
        after = prev
    store_elems(grad_logits, pid, start_vjp(z, g, eps, VARIANT, N), N, TILE_B)
