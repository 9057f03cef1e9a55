"""The three numeric conventions of mHC, as one enum and one table.

| | `paper` | `megatron_main` | `megatron_dev` |
|---|---|---|---|
| Sinkhorn start | `exp(Z)` | `exp(Z - rowmax)` | `softmax(Z) + eps`, then one column step |
| Sinkhorn step | column then row | row then column, `/ clamp(sum, 1e-6)` | row then column, `/ (sum + eps)` |
| residual mix | `H_res @ x` | `H_res @ x` | `H_res^T @ x` |
| H_pre | `sigmoid` | `sigmoid` | `sigmoid + 1e-6` |
| mapping precision | fp32 | activation dtype | fp32 |
| params under a bf16 / fp16 cast | kept fp32 | cast with the model | kept fp32 |
| block exit | mean | mean | mean, or learned contraction |

The full list of differences is in `docs/variants.md`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

__all__ = ["ResidualConstraint", "Variant", "VariantSpec", "VARIANTS", "get_variant"]


class Variant(enum.StrEnum):
    """A named numeric convention of mHC."""

    PAPER = "paper"
    MEGATRON_MAIN = "megatron_main"
    MEGATRON_DEV = "megatron_dev"

    def __str__(self) -> str:  # "paper", not "Variant.PAPER", in ids and messages
        return self.value


class ResidualConstraint(enum.StrEnum):
    """How H_res is formed from its logits."""

    SINKHORN = "sinkhorn"
    """mHC: Sinkhorn-Knopp onto (approximately) doubly stochastic matrices."""
    NONE = "none"
    """Unconstrained Hyper-Connections, the HC paper's dynamic form: ``H_res = I + logits`` (identity at
    init, then whatever training makes of it). The baseline the mHC paper's stability figure compares."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class VariantSpec:
    """Every knob in which the variants differ."""

    variant: Variant
    sinkhorn_start: Literal["exp", "exp_rowmax", "softmax_eps"]
    """How the positive start matrix is formed from the logits."""
    sinkhorn_order: Literal["col_row", "row_col"]
    """Order of the two normalisations inside one iteration."""
    sinkhorn_guard: Literal["none", "clamp", "add"]
    """How a sum is protected: not at all, `clamp(sum, eps)`, or `sum + eps`."""
    sinkhorn_eps: float
    """The eps of the guard (unused with `none`)."""
    exact_sums: Literal["rows", "cols", "none"]
    """Which sums are normalised last, so hold to rounding after any finite iteration count."""
    res_transposed: bool
    """Residual mix `out_i = sum_j H[j, i] x_j` (True) or `sum_j H[i, j] x_j` (False)."""
    h_pre_eps: float
    """Added to `sigmoid(h_pre)`."""
    mapping_fp32: bool
    """Projection, RMS and coefficients in fp32 (True) or in the activation dtype (False)."""
    coefficients_in_activation_dtype: bool
    """Mapping outputs cast back to the activation dtype (True) or kept in the compute dtype."""
    learned_contract: bool
    """The block exit may use the learned contraction (`megatron_dev` only)."""
    params_fp32: bool
    """mHC parameters stay fp32 when the model is cast to fp16 / bf16 (`mhc_core.precision`)."""


VARIANTS: dict[Variant, VariantSpec] = {
    Variant.PAPER: VariantSpec(
        variant=Variant.PAPER,
        sinkhorn_start="exp",
        sinkhorn_order="col_row",
        sinkhorn_guard="none",
        sinkhorn_eps=0.0,
        exact_sums="rows",
        res_transposed=False,
        h_pre_eps=0.0,
        mapping_fp32=True,
        coefficients_in_activation_dtype=False,
        learned_contract=False,
        params_fp32=True,
    ),
    Variant.MEGATRON_MAIN: VariantSpec(
        variant=Variant.MEGATRON_MAIN,
        sinkhorn_start="exp_rowmax",
        sinkhorn_order="row_col",
        sinkhorn_guard="clamp",
        sinkhorn_eps=1e-6,
        exact_sums="cols",
        res_transposed=False,
        h_pre_eps=0.0,
        mapping_fp32=False,
        coefficients_in_activation_dtype=True,
        learned_contract=False,
        params_fp32=False,
    ),
    Variant.MEGATRON_DEV: VariantSpec(
        variant=Variant.MEGATRON_DEV,
        sinkhorn_start="softmax_eps",
        sinkhorn_order="row_col",
        sinkhorn_guard="add",
        sinkhorn_eps=1e-6,
        exact_sums="none",
        res_transposed=True,
        h_pre_eps=1e-6,
        mapping_fp32=True,
        coefficients_in_activation_dtype=True,
        learned_contract=True,
        params_fp32=True,
    ),
}


def get_variant(variant: str | Variant | VariantSpec) -> VariantSpec:
    """Return the spec of `variant`; `ValueError` naming the argument for an unknown name."""
    if isinstance(variant, VariantSpec):
        return variant
    try:
        return VARIANTS[Variant(variant)]
    except ValueError:
        valid = ", ".join(v.value for v in Variant)
        raise ValueError(f"variant={variant!r} is not a known mHC variant; valid: {valid}") from None
