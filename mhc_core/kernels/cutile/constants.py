"""What the kernels and their launch wrappers share, without any import (so `cuda.tile` is not needed
to read them, and a kernel module's compiled bytecode depends on nothing else of the package): the
Sinkhorn form codes (the Sinkhorn kernels' `VARIANT` constant: one per form of start, order and guard,
named after the variant that introduced it; `runtime.SINKHORN_FORM_CODE` maps a variant's form to its code),
the number of normalisation pairs each form runs, and the tensor-core precision codes (the `MMA` constant of the mapping and stream
kernels)."""

from __future__ import annotations

__all__ = ["PAPER", "MAIN", "DEV", "num_pairs", "MMA_BF16", "MMA_TF32", "MMA_3XTF32", "MMA_2XBF16"]

PAPER, MAIN, DEV = 0, 1, 2


def num_pairs(iterations, VARIANT):
    """Pairs of normalisations after the start map: `iterations - 1` for `megatron_dev` (its start
    map ends with a column step), else `iterations`. Called inside the kernels too."""
    if VARIANT == DEV:
        p = iterations - 1
    else:
        p = iterations
    return p


MMA_BF16 = 0
"""bf16 operands (both rounded to bf16)."""
MMA_TF32 = 1
"""TF32 operands (10-bit mantissa; bf16 values are exact)."""
MMA_3XTF32 = 2
"""fp32 operands split into TF32 hi + lo, three products: about fp32 accuracy."""
MMA_2XBF16 = 3
"""The left operand exact in bf16 (bf16 activations), the right fp32 split into bf16 hi + lo, two
products: about 16 significant bits for the right operand, exact for the left."""
