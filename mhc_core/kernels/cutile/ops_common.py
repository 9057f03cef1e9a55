"""What the cuTile launch wrappers share: kernel constants, grid arithmetic, kernel-coverage checks.

The `require_*` checks raise `NotImplementedError` naming a case without a kernel (`n`, dtype,
device); argument errors are the reference's `ValueError`s (`mhc_core.ops`).
"""

from __future__ import annotations

from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.mma_codes import MMA_2XBF16, MMA_3XTF32, MMA_BF16, MMA_TF32
from mhc_core.kernels.cutile.sinkhorn_common import DEV, MAIN, PAPER
from mhc_core.variants import Variant, VariantSpec

__all__ = [
    "VARIANT_CODE",
    "SUPPORTED_DTYPES",
    "MMA_BF16",
    "MMA_TF32",
    "MMA_3XTF32",
    "MMA_2XBF16",
    "cdiv",
    "require_n",
    "require_dtypes",
    "require_no_training_dropout",
    "require_device",
    "mma_mode",
]

VARIANT_CODE = {Variant.PAPER: PAPER, Variant.MEGATRON_MAIN: MAIN, Variant.MEGATRON_DEV: DEV}
"""The `VARIANT` constant of the Sinkhorn kernels."""

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for positive `b`: the number of tiles of size `b` covering `a`."""
    return -(-a // b)


def require_n(n: int, op: str) -> None:
    """`NotImplementedError` unless `n` is in `tiling.SUPPORTED_N`."""
    if n not in tiling.SUPPORTED_N:
        raise NotImplementedError(
            f"cutile {op}: n={n} residual streams has no kernel (supported: {tiling.SUPPORTED_N}, "
            "tile shapes must be powers of two)"
        )


def require_no_training_dropout(op: str, dropout_p: float, training: bool) -> None:
    """`NotImplementedError` for dropout in training (the fused bias-dropout-add has none)."""
    if training and dropout_p > 0:
        raise NotImplementedError(
            f"cutile {op}: dropout_p={dropout_p} in training has no kernel (the fused bias-dropout-add "
            "covers dropout_p == 0 or eval only)"
        )


def require_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    """`NotImplementedError` for a tensor (None skipped) whose dtype is not bf16 / fp32."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(
                f"cutile {op}: {name} has dtype {t.dtype}; the kernels support bfloat16 and float32"
            )


def require_device(rt: Any, op: str, **tensors: torch.Tensor | None) -> None:
    """Let the runtime `rt` check each tensor (None skipped), e.g. that it is on a CUDA device."""
    for name, t in tensors.items():
        if t is not None:
            rt.check_tensor(t, name, op)


def mma_mode(x_dtype: torch.dtype, spec: VariantSpec) -> int:
    """Tensor-core precision of the mapping projection for activations of `x_dtype`.

    Forward: bf16 operands where the reference itself rounds the weight to bf16 (`megatron_main`
    with bf16 activations); TF32 for bf16 activations of the fp32 variants (bf16 is exact in TF32, the
    weight is rounded to TF32); for fp32 activations 3xTF32 (about fp32 accuracy), or plain TF32
    when `torch.backends.cuda.matmul.allow_tf32` allows it for torch's own fp32 matmuls.
    The backward uses `max(mode, TF32)`.
    """
    if x_dtype == torch.bfloat16:
        return MMA_TF32 if spec.mapping_fp32 else MMA_BF16
    return MMA_TF32 if torch.backends.cuda.matmul.allow_tf32 else MMA_3XTF32
