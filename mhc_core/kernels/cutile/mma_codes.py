"""The tensor-core precision codes (the kernels' `MMA` constant), without `cuda.tile`: shared by
the MMA helpers (`mma_common`), the kernels and their launch wrappers."""

from __future__ import annotations

__all__ = ["MMA_BF16", "MMA_TF32", "MMA_3XTF32", "MMA_2XBF16"]

MMA_BF16 = 0
"""bf16 operands (both rounded to bf16)."""
MMA_TF32 = 1
"""TF32 operands (10-bit mantissa; bf16 values are exact)."""
MMA_3XTF32 = 2
"""fp32 operands split into TF32 hi + lo, three products: about fp32 accuracy."""
MMA_2XBF16 = 3
"""The left operand exact in bf16 (bf16 activations), the right fp32 split into bf16 hi + lo, two
products: about 16 significant bits for the right operand, exact for the left."""
