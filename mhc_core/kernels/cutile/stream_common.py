"""What the stream kernels share (a kernel-helper module: imports `cuda.tile`, see
`tools.cutile.emulator.HELPER_MODULES`): fp32 tile loads of the `[T, n, C]` arrays, the residual
mix, the branch `y + bias`, single streams.

The residual mix uses `M = H` (`paper`, `megatron_main`) or `M = H^T` (`megatron_dev`,
`TRANSPOSED=1`): `mix_i = sum_j M[i, j] x_j`. The transpose is a load with axis order
`(0, 2, 1)`, so both orientations read the same contiguous `[T, n, n]` array.
"""

from __future__ import annotations

import cuda.tile as ct

__all__ = ["PAD_ZERO", "F32", "load_f32", "load_mix", "load_branch", "load_stream"]

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
