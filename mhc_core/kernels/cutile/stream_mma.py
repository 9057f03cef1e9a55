"""The tensor-core formulations of the stream kernels (`StreamTiles.mma`; a kernel-helper module:
imports `cuda.tile`, see `tools.cutile.emulator.HELPER_MODULES`).

The block's `TILE_T` tokens and `n` streams are the rows of `[TILE_T*n, TILE_C]` matrices (the
`[TILE_T, n, TILE_C]` tiles reshaped). The forwards multiply them by the block-diagonal matrix of
the block's per-token coefficients (`block_diag`), computed transposed so that the activations
are the left operand; the h_post_bda backward takes its channel sums as products of two such
matrices and keeps the diagonal blocks (`token_diagonal`). The precision is a `mma_codes` code.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.mma_common import MMA_2XBF16, MMA_BF16, mma_at
from mhc_core.kernels.cutile.stream_common import F32, load_branch, load_raw, store_raw

__all__ = ["block_diag", "aggregate_tile_mma", "post_bda_tile_mma", "token_diagonal", "channel_products",
           "aggregate_channel_products"]


def token_eye(TILE_T):
    """`[TILE_T, 1, TILE_T, 1]` fp32: 1 where the two token indices agree, else 0."""
    tok = ct.arange(TILE_T, dtype=ct.int32)
    return ct.where(ct.reshape(tok, (TILE_T, 1, 1, 1)) == ct.reshape(tok, (1, 1, TILE_T, 1)), 1.0, 0.0)


def block_diag(blocks, N, COLS, TILE_T):
    """The block-diagonal `[TILE_T*n, TILE_T*COLS]` fp32 matrix of per-token blocks `[TILE_T, n, COLS]`:
    `out[t*n + a, u*COLS + b] = blocks[t, a, b]` where `t == u`, else 0 (an MMA operand that applies
    each token's small matrix to that token's rows only)."""
    wide = ct.reshape(blocks, (TILE_T, N, 1, COLS)) * token_eye(TILE_T)
    return ct.reshape(wide, (TILE_T * N, TILE_T * COLS))


def aggregate_tile_mma(x, h_diag, out, pt, pc, N, TILE_T, TILE_C, MIX_MMA, LOADS):
    """One output tile of `h_aggregate` on the tensor cores: `out^T [TILE_C, TILE_T] = x2^T @ h_diag`,
    `x2 [TILE_T*n, TILE_C]` the whole `[TILE_T, n, TILE_C]` tile, `h_diag [TILE_T*n, TILE_T]` the
    block's `h_pre` (`block_diag`); stored through a transposed view of `out`."""
    xt = load_raw(x, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
    acc = mma_at(ct.transpose(ct.reshape(xt, (TILE_T * N, TILE_C))), h_diag, ct.zeros((TILE_C, TILE_T), dtype=F32),
                 MIX_MMA)
    store_raw(out, (pc, pt), ct.astype(acc, out.dtype), LOADS, order=(1, 0))


def post_bda_tile_mma(m_diag, hp2, residual, y, bias, out, pt, pc, N, TILE_T, TILE_C, HAS_BIAS, MIX_MMA, LOADS):
    """One output tile of `h_post_bda` with the residual mix on the tensor cores:
    `mix^T [TILE_C, TILE_T*n] = res2^T @ m_diag`, `res2 [TILE_T*n, TILE_C]` the whole residual tile,
    `m_diag` the block-diagonal `M^T` (`m_diag[t*n + j, t*n + i] = M[t, i, j]`); then
    `+ h_post * (y + bias)` and one whole-tile store."""
    res = load_raw(residual, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
    mix_t = mma_at(ct.transpose(ct.reshape(res, (TILE_T * N, TILE_C))), m_diag,
                   ct.zeros((TILE_C, TILE_T * N), dtype=F32), MIX_MMA)
    mix = ct.reshape(ct.transpose(mix_t), (TILE_T, N, TILE_C))
    acc = mix + ct.reshape(hp2, (TILE_T, N, 1)) * load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, LOADS)
    store_raw(out, (pt, 0, pc), ct.astype(acc, out.dtype), LOADS)


def branch_mma(REDUCE_MMA):
    """The precision of the `grad_out x (y + bias)` product: `y + bias` is fp32, not exact in bf16."""
    if REDUCE_MMA == MMA_BF16:
        code = MMA_2XBF16
    else:
        code = REDUCE_MMA
    return code


def token_diagonal(acc, N, COLS, TILE_T):
    """`[TILE_T, n, COLS]` diagonal blocks of a `[TILE_T*n, TILE_T*COLS]` product of token-major
    rows and columns: `out[t, i, j] = acc[t*n + i, t*COLS + j]` (cross-token entries dropped)."""
    return ct.sum(ct.reshape(acc, (TILE_T, N, TILE_T, COLS)) * token_eye(TILE_T), axis=2)


def aggregate_channel_products(grad_out, x, pt, pc, acc, N, TILE_T, TILE_C, REDUCE_MMA, LOADS):
    """One C tile of `h_aggregate`'s backward channel sum on the tensor cores: `acc += x2 @ go^T`
    (`x2 [TILE_T*n, TILE_C]`, `go [TILE_T, TILE_C]`: a `[TILE_T*n, TILE_T]` product whose diagonal
    blocks, `token_diagonal(acc, n, 1)`, are `grad_h_pre`). Returns `acc` and `grad_out`'s tile as
    fp32 `[TILE_T, 1, TILE_C]`."""
    go = load_raw(grad_out, (pt, pc), (TILE_T, TILE_C), LOADS)
    xt = load_raw(x, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
    acc = mma_at(ct.reshape(xt, (TILE_T * N, TILE_C)), ct.transpose(go), acc, REDUCE_MMA)
    return acc, ct.reshape(ct.astype(go, F32), (TILE_T, 1, TILE_C))


def channel_products(grad_out, residual, yb, pt, pc, acc_m, acc_h, N, TILE_T, TILE_C, REDUCE_MMA, LOADS):
    """One C tile of the `n*n + n` channel sums of `h_post_bda`'s backward on the tensor cores.

    With the block's tokens and streams as rows (`go2, res2 [TILE_T*n, TILE_C]`, the `[T, n, C]`
    tiles reshaped), `acc_m += go2 @ res2^T` and `acc_h += go2 @ ybx^T` (`ybx`: `y + bias`
    repeated for each stream) are `[TILE_T*n, TILE_T*n]` products whose diagonal blocks are
    `grad_M` and `grad_h_post` (`token_diagonal`); the rest is waste the tensor cores can afford.
    Returns the accumulators and `grad_out`'s tile as fp32 `[TILE_T, n, TILE_C]`."""
    go = load_raw(grad_out, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
    res = load_raw(residual, (pt, 0, pc), (TILE_T, N, TILE_C), LOADS)
    go2 = ct.reshape(go, (TILE_T * N, TILE_C))
    acc_m = mma_at(go2, ct.transpose(ct.reshape(res, (TILE_T * N, TILE_C))), acc_m, REDUCE_MMA)
    ybx = ct.reshape(ct.broadcast_to(yb, (TILE_T, N, TILE_C)), (TILE_T * N, TILE_C))
    acc_h = mma_at(go2, ct.transpose(ybx), acc_h, branch_mma(REDUCE_MMA))
    return acc_m, acc_h, ct.astype(go, F32)
