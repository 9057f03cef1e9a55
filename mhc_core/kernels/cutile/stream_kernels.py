"""cuTile kernels for the stream ops: `h_aggregate` and `h_post_bda`, forward and backward.

All arithmetic is fp32; each output is rounded once to its array's dtype. `N` is the number of
streams, `TILE_T` tokens and `TILE_C` channels form one tile; arrays are token-major
(`x [T, n, C]`, `y [T, C]`, `h_pre [T, n]`, `h_res [T, n, n]`).

The residual mix uses `M = H` (`paper`, `megatron_main`) or `M = H^T` (`megatron_dev`,
`TRANSPOSED=1`): `mix_i = sum_j M[i, j] x_j`, loaded by `stream_common.load_mix`; `grad_h_res`
is stored back through the same transposed view. The loads live in `stream_common`, the
tensor-core formulations (`StreamTiles.mma`) in `stream_mma`. Every kernel's `LOADS`
(`tiling.load_code`: `StreamTiles.latency`, cuTile's DRAM-latency hint, `StreamTiles.tma` and
`StreamTiles.unchecked`; 0: the compiler decides the first two, every access is bounds-checked)
applies to its streaming loads and stores (activations and gradients, not the per-token
coefficients): `stream_common.load_raw`, `stream_common.store_raw` (bounds only).
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.stream_common import (
    F32,
    load_branch,
    load_f32,
    load_mix,
    load_stream,
    store_raw,
    stream_slice,
)
from mhc_core.kernels.cutile.stream_mma import (
    aggregate_channel_products,
    aggregate_tile_mma,
    block_diag,
    channel_products,
    post_bda_tile_mma,
    token_diagonal,
)

ConstInt = ct.Constant[int]


def _aggregate_tile(x, h, h_diag, out, pt, pc, N, TILE_T, TILE_C, PER_STREAM, MIX_MMA, LOADS):
    """One `[TILE_T, TILE_C]` output tile of `h_aggregate`; `h [TILE_T, n]` fp32 (the block's `h_pre`),
    `h_diag` its block-diagonal form (`MIX_MMA >= 0`)."""
    if MIX_MMA >= 0:
        aggregate_tile_mma(x, h_diag, out, pt, pc, N, TILE_T, TILE_C, MIX_MMA, LOADS)
    else:
        if PER_STREAM:
            acc = ct.zeros((TILE_T, TILE_C), dtype=F32)
            for i in ct.static_iter(range(N)):
                acc = acc + ct.extract(h, (0, i), shape=(TILE_T, 1)) * load_stream(x, pt, i, pc, TILE_T, TILE_C, LOADS)
        else:
            xt = load_f32(x, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
            acc = ct.sum(xt * ct.reshape(h, (TILE_T, N, 1)), axis=1)
        store_raw(out, (pt, pc), ct.astype(acc, out.dtype), LOADS)


@ct.kernel
def h_aggregate_fwd_kernel(x, h_pre, out, N: ConstInt, TILE_T: ConstInt, TILE_C: ConstInt,
                           PER_STREAM: ConstInt, LOOP_C: ConstInt, MIX_MMA: ConstInt, LOADS: ConstInt):
    """`out[t, c] = sum_i h_pre[t, i] x[t, i, c]`; grid `(cdiv(T, TILE_T), cdiv(C, TILE_C))`, or
    `(cdiv(T, TILE_T),)` with `LOOP_C`: each block walks all of C, a loop whose loads the compiler
    can pipeline across iterations (as in the backward kernels).

    `PER_STREAM`: one `[TILE_T, TILE_C]` load per stream, summed in registers; else one
    `[TILE_T, n, TILE_C]` load reduced over its middle axis. `MIX_MMA` >= 0 (a `mma_codes`
    precision; -1: off, and then `PER_STREAM` applies): the sum over streams is a tensor-core
    product of the whole tile with the block-diagonal `h_pre` (`aggregate_tile_mma`).
    """
    pt = ct.bid(0)
    h = load_f32(h_pre, (pt, 0), (TILE_T, N))
    h_diag = block_diag(ct.reshape(h, (TILE_T, N, 1)), N, 1, TILE_T)  # used when MIX_MMA >= 0
    if LOOP_C:
        for pc in range(ct.num_tiles(out, axis=1, shape=(TILE_T, TILE_C))):
            _aggregate_tile(x, h, h_diag, out, pt, pc, N, TILE_T, TILE_C, PER_STREAM, MIX_MMA, LOADS)
    else:
        _aggregate_tile(x, h, h_diag, out, pt, ct.bid(1), N, TILE_T, TILE_C, PER_STREAM, MIX_MMA, LOADS)


@ct.kernel
def h_aggregate_bwd_kernel(grad_out, x, h_pre, grad_x, grad_h,
                           N: ConstInt, TILE_T: ConstInt, TILE_C: ConstInt, REDUCE_MMA: ConstInt, LOADS: ConstInt):
    """`grad_x[t, i, c] = h[t, i] go[t, c]`, `grad_h[t, i] = sum_c go[t, c] x[t, i, c]`.

    Grid `(cdiv(T, TILE_T),)`; each block walks all of `C`, so `grad_h` needs no second pass.
    `REDUCE_MMA` >= 0 (a `mma_codes` precision; -1: off): the channel sum is a tensor-core
    product `x2 @ go^T` (`stream_mma.aggregate_channel_products`) instead of a cross-thread
    reduction per C tile.
    """
    pt = ct.bid(0)
    h = ct.reshape(load_f32(h_pre, (pt, 0), (TILE_T, N)), (TILE_T, N, 1))
    gh = ct.zeros((TILE_T, N), dtype=F32)
    acc = ct.zeros((TILE_T * N, TILE_T), dtype=F32)  # used when REDUCE_MMA >= 0
    for pc in range(ct.num_tiles(grad_out, axis=1, shape=(TILE_T, TILE_C))):
        if REDUCE_MMA >= 0:
            acc, go = aggregate_channel_products(grad_out, x, pt, pc, acc, N, TILE_T, TILE_C, REDUCE_MMA, LOADS)
            store_raw(grad_x, (pt, 0, pc), ct.astype(go * h, grad_x.dtype), LOADS)
        else:
            go = ct.reshape(load_f32(grad_out, (pt, pc), (TILE_T, TILE_C), LOADS), (TILE_T, 1, TILE_C))
            xt = load_f32(x, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
            store_raw(grad_x, (pt, 0, pc), ct.astype(go * h, grad_x.dtype), LOADS)
            gh = gh + ct.sum(go * xt, axis=2)
    if REDUCE_MMA >= 0:
        gh = ct.reshape(token_diagonal(acc, N, 1, TILE_T), (TILE_T, N))
    ct.store(grad_h, index=(pt, 0), tile=ct.astype(gh, grad_h.dtype))


def _post_bda_tile(m, m_diag, hp2, residual, y, bias, out, pt, pc, N, TILE_T, TILE_C, HAS_BIAS, PER_STREAM,
                   MIX_MMA, LOADS):
    """One `[TILE_T, n, TILE_C]` output tile of `h_post_bda` (modes: `h_post_bda_fwd_kernel`); the
    block's mix `m [TILE_T, n, n]`, its block-diagonal `M^T` `m_diag` (`MIX_MMA >= 0`) and
    `hp2 = h_post [TILE_T, n]`, fp32, come loaded."""
    if MIX_MMA >= 0:
        post_bda_tile_mma(m_diag, hp2, residual, y, bias, out, pt, pc, N, TILE_T, TILE_C, HAS_BIAS, MIX_MMA, LOADS)
    elif PER_STREAM == 2:
        yb2 = ct.reshape(load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, LOADS), (TILE_T, TILE_C))
        streams = ()
        for j in ct.static_iter(range(N)):
            streams = streams + (load_stream(residual, pt, j, pc, TILE_T, TILE_C, LOADS),)
        for i in ct.static_iter(range(N)):
            acc2 = ct.extract(hp2, (0, i), shape=(TILE_T, 1)) * yb2
            for j in ct.static_iter(range(N)):
                m_ij = ct.reshape(ct.extract(m, (0, i, j), shape=(TILE_T, 1, 1)), (TILE_T, 1))
                acc2 = acc2 + m_ij * streams[j]
            store_raw(out, (pt, i, pc), ct.astype(ct.reshape(acc2, (TILE_T, 1, TILE_C)), out.dtype), LOADS)
    else:
        res = load_f32(residual, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
        yb = load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, LOADS)
        if PER_STREAM:
            for i in ct.static_iter(range(N)):
                acc = ct.reshape(ct.extract(hp2, (0, i), shape=(TILE_T, 1)), (TILE_T, 1, 1)) * yb
                for j in ct.static_iter(range(N)):
                    acc = acc + ct.extract(m, (0, i, j), shape=(TILE_T, 1, 1)) * ct.extract(
                        res, (0, j, 0), shape=(TILE_T, 1, TILE_C))
                store_raw(out, (pt, i, pc), ct.astype(acc, out.dtype), LOADS)
        else:
            hp = ct.reshape(hp2, (TILE_T, N, 1))
            mix = ct.zeros((TILE_T, N, TILE_C), dtype=F32)
            for j in ct.static_iter(range(N)):
                mix = mix + ct.extract(m, (0, 0, j), shape=(TILE_T, N, 1)) * ct.extract(
                    res, (0, j, 0), shape=(TILE_T, 1, TILE_C))
            acc = mix + hp * yb
            store_raw(out, (pt, 0, pc), ct.astype(acc, out.dtype), LOADS)


@ct.kernel
def h_post_bda_fwd_kernel(h_res, residual, h_post, y, bias, out,
                          N: ConstInt, TILE_T: ConstInt, TILE_C: ConstInt,
                          TRANSPOSED: ConstInt, HAS_BIAS: ConstInt, PER_STREAM: ConstInt, LOOP_C: ConstInt,
                          MIX_MMA: ConstInt, LOADS: ConstInt):
    """`out_i = sum_j M[i, j] residual_j + h_post_i (y + bias)`; grid `(cdiv(T, TILE_T), cdiv(C, TILE_C))`,
    or `(cdiv(T, TILE_T),)` with `LOOP_C` (each block walks all of C, as `h_aggregate_fwd_kernel`).

    `bias [C]` is read only when `HAS_BIAS` (pass any 1-D array otherwise). `PER_STREAM` 1: each
    output stream is computed and stored as its own `[TILE_T, TILE_C]` tile, from slices of one
    `[TILE_T, n, TILE_C]` load; 2: the residual streams are loaded one by one too, into a tuple of
    `[TILE_T, TILE_C]` tiles, so no tile has a middle axis to reshuffle (sm_90: no shared memory,
    against 46 KB and 110 shared loads / stores for 1). `MIX_MMA` >= 0 (a `mma_codes` precision; -1:
    off, and then `PER_STREAM` applies): the mix is a tensor-core product of the whole residual
    tile with the block-diagonal `M^T` (`post_bda_tile_mma`).
    """
    pt = ct.bid(0)
    m = load_mix(h_res, pt, N, TILE_T, TRANSPOSED)
    hp2 = load_f32(h_post, (pt, 0), (TILE_T, N))
    m_diag = block_diag(ct.permute(m, (0, 2, 1)), N, N, TILE_T)  # used when MIX_MMA >= 0
    if LOOP_C:
        for pc in range(ct.num_tiles(y, axis=1, shape=(TILE_T, TILE_C))):
            _post_bda_tile(m, m_diag, hp2, residual, y, bias, out, pt, pc, N, TILE_T, TILE_C, HAS_BIAS, PER_STREAM,
                           MIX_MMA, LOADS)
    else:
        _post_bda_tile(m, m_diag, hp2, residual, y, bias, out, pt, ct.bid(1), N, TILE_T, TILE_C, HAS_BIAS, PER_STREAM,
                       MIX_MMA, LOADS)


def _stream_slices(t, N):
    """The `n` streams of a `[TILE_T, n, TILE_C]` tile as a tuple of `[TILE_T, TILE_C]` tiles."""
    out = ()
    for i in ct.static_iter(range(N)):
        out = out + (stream_slice(t, i),)
    return out


def _stream_grads(gos, m, hp, grad_residual, grad_y, grad_bias_part, pt, pc,
                  N, TILE_T, TILE_C, HAS_BIAS, LOADS):
    """Store `grad_residual_j = sum_i M[i, j] go_i` per stream, `grad_y = sum_i h_post_i go_i` and
    its bias partial, from the tuple `gos` of `[TILE_T, TILE_C]` stream tiles; `hp [TILE_T, n]`."""
    g_y = ct.zeros((TILE_T, TILE_C), dtype=F32)
    for i in ct.static_iter(range(N)):
        g_y = g_y + ct.extract(hp, (0, i), shape=(TILE_T, 1)) * gos[i]
    for j in ct.static_iter(range(N)):
        g_res_j = ct.zeros((TILE_T, TILE_C), dtype=F32)
        for i in ct.static_iter(range(N)):
            m_ij = ct.reshape(ct.extract(m, (0, i, j), shape=(TILE_T, 1, 1)), (TILE_T, 1))
            g_res_j = g_res_j + m_ij * gos[i]
        store_raw(grad_residual, (pt, j, pc),
                  ct.astype(ct.reshape(g_res_j, (TILE_T, 1, TILE_C)), grad_residual.dtype), LOADS)
    store_raw(grad_y, (pt, pc), ct.astype(g_y, grad_y.dtype), LOADS)
    if HAS_BIAS:
        ct.store(grad_bias_part, index=(pt, pc), tile=ct.sum(g_y, axis=0, keepdims=True))


def _channel_sums(parts, COUNT, TILE_T):
    """`out[t, k] = sum_c parts[k][t, c]` `[TILE_T, COUNT]` for a tuple of `COUNT` `[TILE_T, TILE_C]` tiles."""
    flat = ct.arange(COUNT, dtype=ct.int32)
    out = ct.zeros((TILE_T, COUNT), dtype=F32)
    for k in ct.static_iter(range(COUNT)):
        out = out + ct.sum(parts[k], axis=1, keepdims=True) * ct.reshape(ct.where(flat == k, 1.0, 0.0), (1, COUNT))
    return out


@ct.kernel
def h_post_bda_bwd_kernel(grad_out, h_res, residual, h_post, y, bias,
                          grad_h_res, grad_residual, grad_h_post, grad_y, grad_bias_part,
                          N: ConstInt, TILE_T: ConstInt, TILE_C: ConstInt,
                          TRANSPOSED: ConstInt, HAS_BIAS: ConstInt, PER_STREAM: ConstInt,
                          REDUCE_MMA: ConstInt, LOADS: ConstInt):
    """All input gradients of `h_post_bda` in one pass over `grad_out`; grid `(cdiv(T, TILE_T),)`.

    - `grad_residual_j = sum_i M[i, j] go_i`, `grad_M[i, j] = sum_c go_i residual_j`
      (stored transposed back into `grad_h_res` when `TRANSPOSED`);
    - `grad_h_post_i = sum_c go_i (y + bias)`, `grad_y = sum_i h_post_i go_i`;
    - `grad_bias_part [cdiv(T, TILE_T), C]` (fp32, only when `HAS_BIAS`): this block's sum of
      `grad_y` over its tokens, before rounding; the caller sums the rows.

    `PER_STREAM` 1: `grad_residual` and `grad_y` are built from `[TILE_T, TILE_C]` stream slices
    (no sum over, or broadcast along, the middle axis of a 3-D tile) and stored stream by stream.
    2: `grad_out` and `residual` are loaded stream by stream into tuples of `[TILE_T, TILE_C]`
    tiles, and the `n*n + n` channel sums (`grad_M`, `grad_h_post`) are carried as elementwise
    fp32 partials across the C loop, reduced over channels once at the end: no cross-thread
    reduction inside the loop (0 and 1 reduce `n*n + n` times per C tile).

    `REDUCE_MMA` >= 0 (a `mma_codes` precision; -1: off): the channel sums are tensor-core
    products instead (`channel_products`), `grad_residual` and `grad_y` are stored per stream as
    with `PER_STREAM` 1 (which it then ignores).
    """
    pt = ct.bid(0)
    m = load_mix(h_res, pt, N, TILE_T, TRANSPOSED)
    num_c = ct.num_tiles(y, axis=1, shape=(TILE_T, TILE_C))
    if REDUCE_MMA >= 0:
        hp2 = load_f32(h_post, (pt, 0), (TILE_T, N))
        acc_m = ct.zeros((TILE_T * N, TILE_T * N), dtype=F32)
        acc_h = ct.zeros((TILE_T * N, TILE_T * N), dtype=F32)
        for pc in range(num_c):
            yb = load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, LOADS)
            acc_m, acc_h, go = channel_products(grad_out, residual, yb, pt, pc, acc_m, acc_h,
                                                 N, TILE_T, TILE_C, REDUCE_MMA, LOADS)
            _stream_grads(_stream_slices(go, N), m, hp2, grad_residual, grad_y, grad_bias_part, pt, pc, N, TILE_T, TILE_C, HAS_BIAS,
                          LOADS)
        g_m = token_diagonal(acc_m, N, N, TILE_T)
        g_hp = ct.reshape(ct.extract(token_diagonal(acc_h, N, N, TILE_T), (0, 0, 0), shape=(TILE_T, N, 1)), (TILE_T, N))
    elif PER_STREAM == 2:
        hp2 = load_f32(h_post, (pt, 0), (TILE_T, N))
        zero = ct.zeros((TILE_T, TILE_C), dtype=F32)
        part_m = ()  # n*n partials of grad_M, row-major
        part_h = ()  # n partials of grad_h_post
        for _ in ct.static_iter(range(N * N)):
            part_m = part_m + (zero,)
        for _ in ct.static_iter(range(N)):
            part_h = part_h + (zero,)
        for pc in range(num_c):
            gos = ()
            ress = ()
            for i in ct.static_iter(range(N)):
                gos = gos + (load_stream(grad_out, pt, i, pc, TILE_T, TILE_C, LOADS),)
                ress = ress + (load_stream(residual, pt, i, pc, TILE_T, TILE_C, LOADS),)
            yb2 = ct.reshape(load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, LOADS), (TILE_T, TILE_C))
            nxt_m = ()
            nxt_h = ()
            for i in ct.static_iter(range(N)):
                for j in ct.static_iter(range(N)):
                    nxt_m = nxt_m + (part_m[i * N + j] + gos[i] * ress[j],)
                nxt_h = nxt_h + (part_h[i] + gos[i] * yb2,)
            part_m = nxt_m
            part_h = nxt_h
            _stream_grads(gos, m, hp2, grad_residual, grad_y, grad_bias_part, pt, pc, N, TILE_T, TILE_C, HAS_BIAS,
                          LOADS)
        g_m = ct.reshape(_channel_sums(part_m, N * N, TILE_T), (TILE_T, N, N))
        g_hp = _channel_sums(part_h, N, TILE_T)
    else:
        hp = ct.reshape(load_f32(h_post, (pt, 0), (TILE_T, N)), (TILE_T, N, 1))
        lanes = ct.arange(N, dtype=ct.int32)
        g_m = ct.zeros((TILE_T, N, N), dtype=F32)
        g_hp = ct.zeros((TILE_T, N), dtype=F32)
        for pc in range(num_c):
            go = load_f32(grad_out, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
            res = load_f32(residual, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
            for j in ct.static_iter(range(N)):
                col = ct.sum(go * ct.extract(res, (0, j, 0), shape=(TILE_T, 1, TILE_C)), axis=2, keepdims=True)
                onehot = ct.reshape(ct.where(lanes == j, 1.0, 0.0), (1, 1, N))
                g_m = g_m + col * onehot
            g_hp = g_hp + ct.sum(go * load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, LOADS), axis=2)
            if PER_STREAM:
                _stream_grads(_stream_slices(go, N), m, ct.reshape(hp, (TILE_T, N)), grad_residual, grad_y, grad_bias_part, pt, pc,
                              N, TILE_T, TILE_C, HAS_BIAS, LOADS)
            else:
                g_res = ct.zeros((TILE_T, N, TILE_C), dtype=F32)
                for i in ct.static_iter(range(N)):
                    m_row = ct.reshape(ct.extract(m, (0, i, 0), shape=(TILE_T, 1, N)), (TILE_T, N, 1))
                    g_res = g_res + m_row * ct.extract(go, (0, i, 0), shape=(TILE_T, 1, TILE_C))
                store_raw(grad_residual, (pt, 0, pc), ct.astype(g_res, grad_residual.dtype), LOADS)
                g_y = ct.sum(go * hp, axis=1)
                store_raw(grad_y, (pt, pc), ct.astype(g_y, grad_y.dtype), LOADS)
                if HAS_BIAS:
                    ct.store(grad_bias_part, index=(pt, pc), tile=ct.sum(g_y, axis=0, keepdims=True))
    if TRANSPOSED:
        ct.store(grad_h_res, index=(pt, 0, 0), tile=ct.astype(g_m, grad_h_res.dtype), order=(0, 2, 1))
    else:
        ct.store(grad_h_res, index=(pt, 0, 0), tile=ct.astype(g_m, grad_h_res.dtype))
    ct.store(grad_h_post, index=(pt, 0), tile=ct.astype(g_hp, grad_h_post.dtype))
