"""cuTile kernels for the stream ops: `h_aggregate` and `h_post_bda`, forward and backward.

All arithmetic is fp32; each output is rounded once to its array's dtype. `N` is the number of
streams, `TILE_T` tokens and `TILE_C` channels form one tile; arrays are token-major
(`x [T, n, C]`, `y [T, C]`, `h_pre [T, n]`, `h_res [T, n, n]`).

The residual mix uses `M = H` (`paper`, `megatron_main`) or `M = H^T` (`megatron_dev`,
`TRANSPOSED=1`): `mix_i = sum_j M[i, j] x_j`, loaded by `load_mix`; `grad_h_res`
is stored back through the same transposed view. The loads and the
tensor-core `h_aggregate` forward (`StreamTiles.mma`) are the helpers below. How each kernel holds its
tiles is `StreamTiles.per_stream` (`tiling.StreamLayout`): the forwards work per stream, from
slices of one `[TILE_T, n, TILE_C]` load or (`TUPLE`) from each stream loaded alone; the backwards
on whole tiles or (`TUPLE`) stream by stream.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.mma import mma_at

ConstInt = ct.Constant[int]


# --- tile loads: fp32 tiles of the [T, n, C] arrays, the residual mix, the branch y + bias, one stream ----

PAD_ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


def load_f32(arr, index, shape):
    """A zero-padded tile load, as fp32."""
    return ct.astype(ct.load(arr, index=index, shape=shape, padding_mode=PAD_ZERO), F32)


def load_mix(h_res, pt, N, TILE_T, TRANSPOSED):
    """`M [TILE_T, n, n]` with `mix_i = sum_j M[i, j] x_j`."""
    if TRANSPOSED:
        m = ct.load(h_res, index=(pt, 0, 0), shape=(TILE_T, N, N), order=(0, 2, 1), padding_mode=PAD_ZERO)
    else:
        m = ct.load(h_res, index=(pt, 0, 0), shape=(TILE_T, N, N), padding_mode=PAD_ZERO)
    return ct.astype(m, F32)


def load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS):
    """`y + bias` as `[TILE_T, 1, TILE_C]` fp32."""
    yb = load_f32(y, (pt, pc), (TILE_T, TILE_C))
    if HAS_BIAS:
        yb = yb + ct.reshape(load_f32(bias, (pc,), (TILE_C,)), (1, TILE_C))
    return ct.reshape(yb, (TILE_T, 1, TILE_C))


def load_stream(arr, pt, i, pc, TILE_T, TILE_C):
    """Stream `i` of `arr [T, n, C]` at tile `(pt, pc)` as `[TILE_T, TILE_C]` fp32."""
    return ct.reshape(load_f32(arr, (pt, i, pc), (TILE_T, 1, TILE_C)), (TILE_T, TILE_C))


# --- the tensor-core h_aggregate forward (`StreamTiles.mma`) -------------------------------------------
#
# The block's TILE_T tokens and n streams are the rows of a [TILE_T*n, TILE_C] matrix (the
# [TILE_T, n, TILE_C] tile reshaped), multiplied by the block-diagonal matrix of the block's h_pre
# (`block_diag`), computed transposed so that the activations are the left operand; the precision is a
# `constants.MMA_*` code.


def _token_eye(TILE_T):
    """`[TILE_T, 1, TILE_T, 1]` fp32: 1 where the two token indices agree, else 0."""
    tok = ct.arange(TILE_T, dtype=ct.int32)
    return ct.where(ct.reshape(tok, (TILE_T, 1, 1, 1)) == ct.reshape(tok, (1, 1, TILE_T, 1)), 1.0, 0.0)


def block_diag(blocks, N, COLS, TILE_T):
    """The block-diagonal `[TILE_T*n, TILE_T*COLS]` fp32 matrix of per-token blocks `[TILE_T, n, COLS]`:
    `out[t*n + a, u*COLS + b] = blocks[t, a, b]` where `t == u`, else 0 (an MMA operand that applies
    each token's small matrix to that token's rows only)."""
    wide = ct.reshape(blocks, (TILE_T, N, 1, COLS)) * _token_eye(TILE_T)
    return ct.reshape(wide, (TILE_T * N, TILE_T * COLS))


def aggregate_tile_mma(x, h_diag, out, pt, pc, N, TILE_T, TILE_C, MMA):
    """One output tile of `h_aggregate` on the tensor cores: `out^T [TILE_C, TILE_T] = x2^T @ h_diag`,
    `x2 [TILE_T*n, TILE_C]` the whole `[TILE_T, n, TILE_C]` tile, `h_diag [TILE_T*n, TILE_T]` the
    block's `h_pre` (`block_diag`); stored through a transposed view of `out`."""
    xt = ct.load(x, index=(pt, 0, pc), shape=(TILE_T, N, TILE_C), padding_mode=PAD_ZERO)
    acc = mma_at(
        ct.transpose(ct.reshape(xt, (TILE_T * N, TILE_C))), h_diag, ct.zeros((TILE_C, TILE_T), dtype=F32), MMA
    )
    ct.store(out, index=(pc, pt), tile=ct.astype(acc, out.dtype), order=(1, 0))


# --- the kernels -----------------------------------------------------------------------------------


def _aggregate_tile(x, h, h_diag, out, pt, pc, N, TILE_T, TILE_C, TENSOR_CORES, MMA):
    """One `[TILE_T, TILE_C]` output tile of `h_aggregate`; `h [TILE_T, n]` fp32 (the block's `h_pre`),
    `h_diag` its block-diagonal form (used with `TENSOR_CORES`)."""
    if TENSOR_CORES:
        aggregate_tile_mma(x, h_diag, out, pt, pc, N, TILE_T, TILE_C, MMA)
    else:
        acc = ct.zeros((TILE_T, TILE_C), dtype=F32)
        for i in ct.static_iter(range(N)):
            acc = acc + ct.extract(h, (0, i), shape=(TILE_T, 1)) * load_stream(x, pt, i, pc, TILE_T, TILE_C)
        ct.store(out, index=(pt, pc), tile=ct.astype(acc, out.dtype))


@ct.kernel
def h_aggregate_fwd_kernel(
    x,
    h_pre,
    out,
    N: ConstInt,
    TILE_T: ConstInt,
    TILE_C: ConstInt,
    LOOP_C: ConstInt,
    TENSOR_CORES: ConstInt,
    MMA: ConstInt,
):
    """`out[t, c] = sum_i h_pre[t, i] x[t, i, c]`; grid `(cdiv(T, TILE_T), cdiv(C, TILE_C))`, or
    `(cdiv(T, TILE_T),)` with `LOOP_C`: each block walks all of C, a loop whose loads the compiler
    can pipeline across iterations (as in the backward kernels).

    One `[TILE_T, TILE_C]` load per stream, summed in registers; with `TENSOR_CORES` the sum over
    streams is instead a tensor-core product, at precision `MMA` (a `constants.MMA_*` code), of the whole
    `[TILE_T, n, TILE_C]` tile with the block-diagonal `h_pre` (`aggregate_tile_mma`).
    """
    pt = ct.bid(0)
    h = load_f32(h_pre, (pt, 0), (TILE_T, N))
    h_diag = block_diag(ct.reshape(h, (TILE_T, N, 1)), N, 1, TILE_T)  # used with TENSOR_CORES
    if LOOP_C:
        for pc in range(ct.num_tiles(out, axis=1, shape=(TILE_T, TILE_C))):
            _aggregate_tile(x, h, h_diag, out, pt, pc, N, TILE_T, TILE_C, TENSOR_CORES, MMA)
    else:
        _aggregate_tile(x, h, h_diag, out, pt, ct.bid(1), N, TILE_T, TILE_C, TENSOR_CORES, MMA)


@ct.kernel
def h_aggregate_bwd_kernel(
    grad_out, x, h_pre, grad_x, grad_h, N: ConstInt, TILE_T: ConstInt, TILE_C: ConstInt
):
    """`grad_x[t, i, c] = h[t, i] go[t, c]`, `grad_h[t, i] = sum_c go[t, c] x[t, i, c]`.

    Grid `(cdiv(T, TILE_T),)`; each block walks all of `C`, so `grad_h` needs no second pass.
    """
    pt = ct.bid(0)
    h = ct.reshape(load_f32(h_pre, (pt, 0), (TILE_T, N)), (TILE_T, N, 1))
    gh = ct.zeros((TILE_T, N), dtype=F32)
    for pc in range(ct.num_tiles(grad_out, axis=1, shape=(TILE_T, TILE_C))):
        go = ct.reshape(load_f32(grad_out, (pt, pc), (TILE_T, TILE_C)), (TILE_T, 1, TILE_C))
        xt = load_f32(x, (pt, 0, pc), (TILE_T, N, TILE_C))
        ct.store(grad_x, index=(pt, 0, pc), tile=ct.astype(go * h, grad_x.dtype))
        gh = gh + ct.sum(go * xt, axis=2)
    ct.store(grad_h, index=(pt, 0), tile=ct.astype(gh, grad_h.dtype))


@ct.kernel
def h_aggregate_bwd_h_kernel(grad_out, x, grad_h, N: ConstInt, TILE_T: ConstInt, TILE_C: ConstInt):
    """`grad_h[t, i] = sum_c go[t, c] x[t, i, c]` alone, fp32 (the fused pre-op's: its one gradient of x comes
    from the mapping's dx kernel). Grid `(cdiv(T, TILE_T),)`; each block walks all of `C`."""
    pt = ct.bid(0)
    gh = ct.zeros((TILE_T, N), dtype=F32)
    for pc in range(ct.num_tiles(grad_out, axis=1, shape=(TILE_T, TILE_C))):
        go = ct.reshape(load_f32(grad_out, (pt, pc), (TILE_T, TILE_C)), (TILE_T, 1, TILE_C))
        gh = gh + ct.sum(go * load_f32(x, (pt, 0, pc), (TILE_T, N, TILE_C)), axis=2)
    ct.store(grad_h, index=(pt, 0), tile=gh)


def _post_bda_tile(m, hp2, residual, y, bias, out, pt, pc, N, TILE_T, TILE_C, HAS_BIAS, TUPLE):
    """One `[TILE_T, n, TILE_C]` output tile of `h_post_bda`, stream by stream (`h_post_bda_fwd_kernel`);
    the block's mix `m [TILE_T, n, n]` and `hp2 = h_post [TILE_T, n]`, fp32, come loaded."""
    if TUPLE:
        yb2 = ct.reshape(load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS), (TILE_T, TILE_C))
        streams = ()
        for j in ct.static_iter(range(N)):
            streams = streams + (load_stream(residual, pt, j, pc, TILE_T, TILE_C),)
        for i in ct.static_iter(range(N)):
            acc2 = ct.extract(hp2, (0, i), shape=(TILE_T, 1)) * yb2
            for j in ct.static_iter(range(N)):
                m_ij = ct.reshape(ct.extract(m, (0, i, j), shape=(TILE_T, 1, 1)), (TILE_T, 1))
                acc2 = acc2 + m_ij * streams[j]
            ct.store(out, index=(pt, i, pc), tile=ct.astype(ct.reshape(acc2, (TILE_T, 1, TILE_C)), out.dtype))
    else:
        res = load_f32(residual, (pt, 0, pc), (TILE_T, N, TILE_C))
        yb = load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS)
        for i in ct.static_iter(range(N)):
            acc = ct.reshape(ct.extract(hp2, (0, i), shape=(TILE_T, 1)), (TILE_T, 1, 1)) * yb
            for j in ct.static_iter(range(N)):
                acc = acc + ct.extract(m, (0, i, j), shape=(TILE_T, 1, 1)) * ct.extract(
                    res, (0, j, 0), shape=(TILE_T, 1, TILE_C)
                )
            ct.store(out, index=(pt, i, pc), tile=ct.astype(acc, out.dtype))


@ct.kernel
def h_post_bda_fwd_kernel(
    h_res,
    residual,
    h_post,
    y,
    bias,
    out,
    N: ConstInt,
    TILE_T: ConstInt,
    TILE_C: ConstInt,
    TRANSPOSED: ConstInt,
    HAS_BIAS: ConstInt,
    LOOP_C: ConstInt,
    TUPLE: ConstInt,
):
    """`out_i = sum_j M[i, j] residual_j + h_post_i (y + bias)`; grid `(cdiv(T, TILE_T), cdiv(C, TILE_C))`,
    or `(cdiv(T, TILE_T),)` with `LOOP_C` (each block walks all of C, as `h_aggregate_fwd_kernel`).

    `bias [C]` is read only when `HAS_BIAS` (pass any 1-D array otherwise). Each output stream is
    computed and stored as its own `[TILE_T, TILE_C]` tile, from slices of one `[TILE_T, n, TILE_C]`
    load; with `TUPLE` the residual streams are loaded one by one too, into a tuple of
    `[TILE_T, TILE_C]` tiles, so no tile has a middle axis to reshuffle (sm_90: no shared memory,
    against 46 KB and 110 shared loads / stores from the slices).
    """
    pt = ct.bid(0)
    m = load_mix(h_res, pt, N, TILE_T, TRANSPOSED)
    hp2 = load_f32(h_post, (pt, 0), (TILE_T, N))
    if LOOP_C:
        for pc in range(ct.num_tiles(y, axis=1, shape=(TILE_T, TILE_C))):
            _post_bda_tile(m, hp2, residual, y, bias, out, pt, pc, N, TILE_T, TILE_C, HAS_BIAS, TUPLE)
    else:
        _post_bda_tile(m, hp2, residual, y, bias, out, pt, ct.bid(1), N, TILE_T, TILE_C, HAS_BIAS, TUPLE)


def _stream_grads(gos, m, hp, grad_residual, grad_y, grad_bias_part, pt, pc, N, TILE_T, TILE_C, HAS_BIAS):
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
        ct.store(
            grad_residual,
            index=(pt, j, pc),
            tile=ct.astype(ct.reshape(g_res_j, (TILE_T, 1, TILE_C)), grad_residual.dtype),
        )
    ct.store(grad_y, index=(pt, pc), tile=ct.astype(g_y, grad_y.dtype))
    if HAS_BIAS:
        ct.store(grad_bias_part, index=(pt, pc), tile=ct.sum(g_y, axis=0, keepdims=True))


def _channel_sums(parts, COUNT, TILE_T):
    """`out[t, k] = sum_c parts[k][t, c]` `[TILE_T, COUNT]` for a tuple of `COUNT` `[TILE_T, TILE_C]` tiles."""
    flat = ct.arange(COUNT, dtype=ct.int32)
    out = ct.zeros((TILE_T, COUNT), dtype=F32)
    for k in ct.static_iter(range(COUNT)):
        out = out + ct.sum(parts[k], axis=1, keepdims=True) * ct.reshape(
            ct.where(flat == k, 1.0, 0.0), (1, COUNT)
        )
    return out


@ct.kernel
def h_post_bda_bwd_kernel(
    grad_out,
    h_res,
    residual,
    h_post,
    y,
    bias,
    grad_h_res,
    grad_residual,
    grad_h_post,
    grad_y,
    grad_bias_part,
    N: ConstInt,
    TILE_T: ConstInt,
    TILE_C: ConstInt,
    TRANSPOSED: ConstInt,
    HAS_BIAS: ConstInt,
    TUPLE: ConstInt,
):
    """All input gradients of `h_post_bda` in one pass over `grad_out`; grid `(cdiv(T, TILE_T),)`.

    - `grad_residual_j = sum_i M[i, j] go_i`, `grad_M[i, j] = sum_c go_i residual_j`
      (stored transposed back into `grad_h_res` when `TRANSPOSED`);
    - `grad_h_post_i = sum_c go_i (y + bias)`, `grad_y = sum_i h_post_i go_i`;
    - `grad_bias_part [cdiv(T, TILE_T), C]` (fp32, only when `HAS_BIAS`): this block's sum of
      `grad_y` over its tokens, before rounding; the caller sums the rows.

    Whole `[TILE_T, n, TILE_C]` tiles, reducing the `n*n + n` channel sums per C tile; with `TUPLE`,
    `grad_out` and `residual` are loaded stream by stream into tuples of `[TILE_T, TILE_C]` tiles,
    `grad_residual` and `grad_y` stored stream by stream, and the channel sums (`grad_M`,
    `grad_h_post`) carried as elementwise fp32 partials across the C loop, reduced over channels
    once at the end: no cross-thread reduction inside the loop.
    """
    pt = ct.bid(0)
    m = load_mix(h_res, pt, N, TILE_T, TRANSPOSED)
    num_c = ct.num_tiles(y, axis=1, shape=(TILE_T, TILE_C))
    if TUPLE:
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
                gos = gos + (load_stream(grad_out, pt, i, pc, TILE_T, TILE_C),)
                ress = ress + (load_stream(residual, pt, i, pc, TILE_T, TILE_C),)
            yb2 = ct.reshape(load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS), (TILE_T, TILE_C))
            nxt_m = ()
            nxt_h = ()
            for i in ct.static_iter(range(N)):
                for j in ct.static_iter(range(N)):
                    nxt_m = nxt_m + (part_m[i * N + j] + gos[i] * ress[j],)
                nxt_h = nxt_h + (part_h[i] + gos[i] * yb2,)
            part_m = nxt_m
            part_h = nxt_h
            _stream_grads(
                gos, m, hp2, grad_residual, grad_y, grad_bias_part, pt, pc, N, TILE_T, TILE_C, HAS_BIAS
            )
        g_m = ct.reshape(_channel_sums(part_m, N * N, TILE_T), (TILE_T, N, N))
        g_hp = _channel_sums(part_h, N, TILE_T)
    else:
        hp = ct.reshape(load_f32(h_post, (pt, 0), (TILE_T, N)), (TILE_T, N, 1))
        lanes = ct.arange(N, dtype=ct.int32)
        g_m = ct.zeros((TILE_T, N, N), dtype=F32)
        g_hp = ct.zeros((TILE_T, N), dtype=F32)
        for pc in range(num_c):
            go = load_f32(grad_out, (pt, 0, pc), (TILE_T, N, TILE_C))
            res = load_f32(residual, (pt, 0, pc), (TILE_T, N, TILE_C))
            for j in ct.static_iter(range(N)):
                col = ct.sum(
                    go * ct.extract(res, (0, j, 0), shape=(TILE_T, 1, TILE_C)), axis=2, keepdims=True
                )
                onehot = ct.reshape(ct.where(lanes == j, 1.0, 0.0), (1, 1, N))
                g_m = g_m + col * onehot
            g_hp = g_hp + ct.sum(go * load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS), axis=2)
            g_res = ct.zeros((TILE_T, N, TILE_C), dtype=F32)
            for i in ct.static_iter(range(N)):
                m_row = ct.reshape(ct.extract(m, (0, i, 0), shape=(TILE_T, 1, N)), (TILE_T, N, 1))
                g_res = g_res + m_row * ct.extract(go, (0, i, 0), shape=(TILE_T, 1, TILE_C))
            ct.store(grad_residual, index=(pt, 0, pc), tile=ct.astype(g_res, grad_residual.dtype))
            g_y = ct.sum(go * hp, axis=1)
            ct.store(grad_y, index=(pt, pc), tile=ct.astype(g_y, grad_y.dtype))
            if HAS_BIAS:
                ct.store(grad_bias_part, index=(pt, pc), tile=ct.sum(g_y, axis=0, keepdims=True))
    if TRANSPOSED:
        ct.store(grad_h_res, index=(pt, 0, 0), tile=ct.astype(g_m, grad_h_res.dtype), order=(0, 2, 1))
    else:
        ct.store(grad_h_res, index=(pt, 0, 0), tile=ct.astype(g_m, grad_h_res.dtype))
    ct.store(grad_h_post, index=(pt, 0), tile=ct.astype(g_hp, grad_h_post.dtype))
