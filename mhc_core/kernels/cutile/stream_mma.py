"""The tensor-core formulation of the `h_aggregate` forward (`StreamTiles.mma`; a kernel-helper
module: imports `cuda.tile`, see `tools.cutile.emulator.HELPER_MODULES`).

The block's `TILE_T` tokens and `n` streams are the rows of a `[TILE_T*n, TILE_C]` matrix (the
`[TILE_T, n, TILE_C]` tile reshaped), multiplied by the block-diagonal matrix of the block's
`h_pre` (`block_diag`), computed transposed so that the activations are the left operand. The
precision is a `mma_codes` code.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.mma_common import mma_at
from mhc_core.kernels.cutile.stream_common import F32, PAD_ZERO

__all__ = ["block_diag", "aggregate_tile_mma"]


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
    acc = mma_at(ct.transpose(ct.reshape(xt, (TILE_T * N, TILE_C))), h_diag, ct.zeros((TILE_C, TILE_T), dtype=F32),
                 MMA)
    ct.store(out, index=(pc, pt), tile=ct.astype(acc, out.dtype), order=(1, 0))
