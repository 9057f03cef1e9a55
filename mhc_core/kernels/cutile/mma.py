"""Tensor-core products at a chosen precision, for the mapping and stream kernels: `mma_at(a, b, acc, MMA)`.

The one kernel-helper module (imports `cuda.tile`; the CPU interpreter loads it with its stand-in, see
`tools.cutile.emulator.HELPER_MODULES`). The codes are in `constants` (no `cuda.tile`), which the launch
wrappers use.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.constants import MMA_2XBF16, MMA_3XTF32, MMA_BF16, MMA_TF32

__all__ = ["mma_at", "MMA_BF16", "MMA_TF32", "MMA_3XTF32", "MMA_2XBF16"]

F32 = ct.float32


def _split(v, dtype):
    """fp32 `v` as `hi + lo` in `dtype` (tf32 or bf16): hi rounded, lo the rounded remainder."""
    hi = ct.astype(v, dtype)
    lo = ct.astype(v - ct.astype(hi, F32), dtype)
    return hi, lo


def mma_at(a, b, acc, MMA):
    """`acc + a @ b` with fp32 accumulation at the precision `MMA` (`constants`)."""
    if MMA == MMA_BF16:
        out = ct.mma(ct.astype(a, ct.bfloat16), ct.astype(b, ct.bfloat16), acc)
    elif MMA == MMA_TF32:
        out = ct.mma(
            ct.astype(ct.astype(a, F32), ct.tfloat32), ct.astype(ct.astype(b, F32), ct.tfloat32), acc
        )
    elif MMA == MMA_2XBF16:
        # As for 3xTF32: each product gets its own zero accumulator and joins `acc` in fp32.
        a16 = ct.astype(a, ct.bfloat16)
        b_hi, b_lo = _split(ct.astype(b, F32), ct.bfloat16)
        small = ct.mma(a16, b_lo, ct.zeros(acc.shape, dtype=F32))
        out = acc + (ct.mma(a16, b_hi, ct.zeros(acc.shape, dtype=F32)) + small)
    else:
        # Each product gets its own zero accumulator and joins `acc` with a plain fp32 add: the
        # tensor cores accumulate with truncation, so chaining `acc` through them loses bits.
        a_hi, a_lo = _split(ct.astype(a, F32), ct.tfloat32)
        b_hi, b_lo = _split(ct.astype(b, F32), ct.tfloat32)
        small = ct.mma(a_lo, b_hi, ct.zeros(acc.shape, dtype=F32))
        small = ct.mma(a_hi, b_lo, small)
        out = acc + (ct.mma(a_hi, b_hi, ct.zeros(acc.shape, dtype=F32)) + small)
    return out
