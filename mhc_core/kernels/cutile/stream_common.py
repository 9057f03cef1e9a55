"""What the stream kernels share (a kernel-helper module: imports `cuda.tile`, see
`tools.cutile.emulator.HELPER_MODULES`): fp32 tile loads of the `[T, n, C]` arrays and their stores, under the
kernel's load code (`tiling.load_code`), the residual mix, the branch `y + bias`, single streams.

The residual mix uses `M = H` (`paper`, `megatron_main`) or `M = H^T` (`megatron_dev`,
`TRANSPOSED=1`): `mix_i = sum_j M[i, j] x_j`. The transpose is a load with axis order
`(0, 2, 1)`, so both orientations read the same contiguous `[T, n, n]` array.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.load_codes import NO_TMA, UNCHECKED

__all__ = ["PAD_ZERO", "F32", "load_raw", "store_raw", "load_f32", "load_mix", "load_branch", "load_stream", "stream_slice"]

PAD_ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


def load_raw(arr, index, shape, loads=0):
    """A zero-padded tile load under the load code `loads` (`tiling.load_code`): `loads % 16` is
    cuTile's DRAM-latency hint, 1-10 (`StreamTiles.latency`: the depth of the compiler's load
    pipeline; 0 leaves it to the compiler); `loads % 32 >= 16` forbids TMA (`StreamTiles.tma` False:
    plain global loads, which the compiler prefetches into registers instead of shared memory);
    `loads >= 32` skips the bounds check (`StreamTiles.unchecked`, set only for a launch of whole tiles:
    every tile is in bounds, so the padding never applies)."""
    latency = loads % NO_TMA
    if loads >= UNCHECKED:  # no padding either: tileiras 13.4 fails on a padded unchecked load
        if latency > 0:
            t = ct.load(arr, index=index, shape=shape, check_bounds=False, latency=latency,
                        allow_tma=loads % UNCHECKED < NO_TMA)
        else:
            t = ct.load(arr, index=index, shape=shape, check_bounds=False, allow_tma=loads % UNCHECKED < NO_TMA)
    elif loads >= NO_TMA:
        if latency > 0:
            t = ct.load(arr, index=index, shape=shape, padding_mode=PAD_ZERO, latency=latency, allow_tma=False)
        else:
            t = ct.load(arr, index=index, shape=shape, padding_mode=PAD_ZERO, allow_tma=False)
    elif latency > 0:
        t = ct.load(arr, index=index, shape=shape, padding_mode=PAD_ZERO, latency=latency)
    else:
        t = ct.load(arr, index=index, shape=shape, padding_mode=PAD_ZERO)
    return t


def store_raw(arr, index, tile, loads=0, order="C"):
    """`ct.store` of a streaming tile (an activation or gradient, `[T, n, C]` / `[T, C]`) under the load code
    `loads`: without the bounds check with unchecked loads (`loads >= 32`, a launch of whole tiles)."""
    ct.store(arr, index=index, tile=tile, order=order, check_bounds=loads < UNCHECKED)


def load_f32(arr, index, shape, loads=0):
    return ct.astype(load_raw(arr, index, shape, loads), F32)


def load_mix(h_res, pt, N, TILE_T, TRANSPOSED):
    """`M [TILE_T, n, n]` with `mix_i = sum_j M[i, j] x_j`."""
    if TRANSPOSED:
        m = ct.load(h_res, index=(pt, 0, 0), shape=(TILE_T, N, N), order=(0, 2, 1), padding_mode=PAD_ZERO)
    else:
        m = ct.load(h_res, index=(pt, 0, 0), shape=(TILE_T, N, N), padding_mode=PAD_ZERO)
    return ct.astype(m, F32)


def load_branch(y, bias, pt, pc, TILE_T, TILE_C, HAS_BIAS, loads=0):
    """`y + bias` as `[TILE_T, 1, TILE_C]` fp32 (`loads` for `y`: `load_raw`)."""
    yb = load_f32(y, (pt, pc), (TILE_T, TILE_C), loads)
    if HAS_BIAS:
        yb = yb + ct.reshape(load_f32(bias, (pc,), (TILE_C,)), (1, TILE_C))
    return ct.reshape(yb, (TILE_T, 1, TILE_C))


def load_stream(arr, pt, i, pc, TILE_T, TILE_C, loads=0):
    """Stream `i` of `arr [T, n, C]` at tile `(pt, pc)` as `[TILE_T, TILE_C]` fp32."""
    return ct.reshape(load_f32(arr, (pt, i, pc), (TILE_T, 1, TILE_C), loads), (TILE_T, TILE_C))


def stream_slice(t, i):
    """Stream `i` of a `[TILE_T, n, TILE_C]` tile as `[TILE_T, TILE_C]`."""
    return ct.reshape(ct.extract(t, (0, i, 0), shape=(t.shape[0], 1, t.shape[2])), (t.shape[0], t.shape[2]))
