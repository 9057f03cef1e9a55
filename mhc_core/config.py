"""`HyperConnectionConfig`: the settings of one `HyperConnectionModule`, megatron-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mhc_core.checks import as_int
from mhc_core.forms import ConnectionForm
from mhc_core.variants import (
    OPTION_KINDS,
    CoefficientPrecision,
    MappingPrecision,
    NormEpsPlacement,
    NumericsOptions,
    OutputContraction,
    ResidualConstraint,
    ResidualMix,
    SinkhornPrecision,
    Variant,
    VariantSpec,
    configure,
    get_variant,
)

__all__ = ["HyperConnectionConfig"]


@dataclass(frozen=True, kw_only=True)
class HyperConnectionConfig:
    """Settings of an mHC sublayer connection; field names follow upstream's `mhc_*` config."""

    hidden_size: int
    """C, the width of one stream."""
    num_residual_streams: int = 4
    """n (upstream `mhc_num_residual_streams`)."""
    sinkhorn_iterations: int = 20
    """Upstream `mhc_sinkhorn_iterations`; >= 1."""
    init_gating_factor: float = 0.01
    """Initial value of the three alphas (upstream `mhc_init_gating_factor`); >= 0."""
    variant: Variant = Variant.MEGATRON_MAIN
    """Numeric convention: `paper`, `megatron_main` or `megatron_dev` (a configuration name such as
    `megatron_dev+eps_inside_sqrt` sets the option fields below, which must then be None)."""
    norm_eps: float = 1e-6
    """eps of the RMS norm of the mapping."""
    norm_eps_placement: NormEpsPlacement | None = None
    """`outside_sqrt` or `inside_sqrt`; None: the variant's (outside for all three)."""
    mapping_precision: MappingPrecision | None = None
    """`fp32` or `activation`: the mapping's compute dtype and whether its parameters stay fp32 under a
    half-precision cast; None: the variant's."""
    output_contraction: OutputContraction | None = None
    """`mean` or `learned`: the block exit a model built on this config uses (the module itself has no
    exit; `mhc_core.contraction.LearnedContraction` is the learned one); None: the variant's (mean)."""
    residual_mix: ResidualMix | None = None
    """`untransposed` (`H @ x`) or `transposed` (`H^T @ x`); None: the variant's."""
    coefficient_precision: CoefficientPrecision | None = None
    """`activation` (coefficients cast to the activation dtype) or `compute` (kept in the mapping's compute dtype,
    fp32 under fp32 mappings); None: the variant's."""
    sinkhorn_precision: SinkhornPrecision | None = None
    """`fp32` (Sinkhorn iterates in fp32 at least) or `input` (in the logits' own dtype); None: the variant's
    (fp32)."""
    form: ConnectionForm = ConnectionForm.PER_SUBLAYER
    """`per_sublayer` (mHC, DeepSeek-V4) or `single_pass` (DeepSeek-V4.1: the aggregate uses the previous
    sublayer's `H_pre`; `mhc_core.forms`). Which call the module answers: `forward` or `single_pass`."""
    use_fused: bool = False
    """Route the ops through `mhc_core.kernels` (upstream `use_fused_mhc`)."""
    perform_initialization: bool = True
    """Initialise `mapping_proj.weight` with xavier-uniform (else leave it zero)."""
    sequence_parallel: bool = False
    """Tag the parameters `sequence_parallel=True` so Megatron all-reduces their grads over TP."""
    h_res_constraint: ResidualConstraint = ResidualConstraint.SINKHORN
    """`sinkhorn` (mHC), `none`: unconstrained Hyper-Connections, `H_res = I + logits` (the baseline of
    the paper's stability comparison), or `permutations`: mHC-lite, a softmax mixture of the n! permutation
    matrices (n <= 6)."""

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"HyperConnectionConfig.{field}={value!r}: {rule}")

        for field in ("hidden_size", "num_residual_streams", "sinkhorn_iterations"):
            v = getattr(self, field)
            iv = as_int(v)
            if iv is None or iv < 1:
                raise bad(field, v, "must be an integer >= 1")
            object.__setattr__(self, field, iv)  # a NumPy integer becomes an int
        if not (self.init_gating_factor >= 0 and math.isfinite(self.init_gating_factor)):
            raise bad("init_gating_factor", self.init_gating_factor, "must be a finite number >= 0")
        if not (self.norm_eps >= 0 and math.isfinite(self.norm_eps)):
            raise bad("norm_eps", self.norm_eps, "must be a finite number >= 0")
        try:
            spec = get_variant(self.variant)
        except ValueError as exc:
            raise bad(
                "variant", self.variant, f"valid: {', '.join(v.value for v in Variant)}; {exc}"
            ) from None
        for field, kind in OPTION_KINDS.items():
            v = getattr(self, field)
            if v is None:
                if spec.options:  # a configuration name fills the options it names
                    object.__setattr__(self, field, getattr(spec, field))
                continue
            if spec.options:
                raise bad(field, v, f"is set twice: variant={spec.name!r} names the options already")
            try:
                object.__setattr__(self, field, kind(v))
            except ValueError:
                raise bad(field, v, f"valid: {', '.join(k.value for k in kind)}") from None
        object.__setattr__(self, "variant", spec.variant)
        try:
            object.__setattr__(self, "form", ConnectionForm(self.form))
        except ValueError:
            raise bad("form", self.form, f"valid: {', '.join(f.value for f in ConnectionForm)}") from None
        if self.form == ConnectionForm.SINGLE_PASS and self.output_contraction == OutputContraction.LEARNED:
            raise bad(
                "output_contraction",
                self.output_contraction.value,
                "single_pass exits with the last sublayer's H_pre, not a learned head; use 'mean' or None",
            )
        try:
            object.__setattr__(self, "h_res_constraint", ResidualConstraint(self.h_res_constraint))
        except ValueError:
            raise bad(
                "h_res_constraint",
                self.h_res_constraint,
                f"valid: {', '.join(c.value for c in ResidualConstraint)}",
            ) from None
        if self.h_res_constraint == ResidualConstraint.PERMUTATIONS and self.num_residual_streams > 6:
            raise bad(
                "h_res_constraint",
                self.h_res_constraint,
                f"needs num_residual_streams <= 6 (n! = {math.factorial(self.num_residual_streams)} logits "
                f"per token at n={self.num_residual_streams})",
            )

    @property
    def numerics(self) -> VariantSpec:
        """The variant with this config's options: what the ops are given (`spec.name` names it)."""
        return configure(
            self.variant,
            NumericsOptions(
                norm_eps_placement=self.norm_eps_placement,
                mapping_precision=self.mapping_precision,
                output_contraction=self.output_contraction,
                residual_mix=self.residual_mix,
                coefficient_precision=self.coefficient_precision,
                sinkhorn_precision=self.sinkhorn_precision,
            ),
        )

    @property
    def num_mapping_outputs(self) -> int:
        """N = n*n + 2n (2n + n! for the permutation mixture, mHC-lite)."""
        from mhc_core.ops.mapping import num_mapping_outputs

        return num_mapping_outputs(self.num_residual_streams, self.h_res_constraint)

    @classmethod
    def from_transformer_config(cls, config: Any) -> HyperConnectionConfig:
        """Read the upstream field names off a megatron-core `TransformerConfig` (or any object)."""
        return cls(
            hidden_size=config.hidden_size,
            num_residual_streams=getattr(config, "mhc_num_residual_streams", 4),
            sinkhorn_iterations=getattr(config, "mhc_sinkhorn_iterations", 20),
            init_gating_factor=getattr(config, "mhc_init_gating_factor", 0.01),
            variant=getattr(config, "mhc_variant", Variant.MEGATRON_MAIN),
            norm_eps_placement=_flag(
                config,
                "mhc_norm_eps_inside_sqrt",
                NormEpsPlacement.INSIDE_SQRT,
                NormEpsPlacement.OUTSIDE_SQRT,
            ),
            mapping_precision=_flag(
                config, "mhc_keep_mappings_in_fp32", MappingPrecision.FP32, MappingPrecision.ACTIVATION
            ),
            output_contraction=_flag(config, "mhc_learned_contraction", OutputContraction.LEARNED, None),
            coefficient_precision=_flag(
                config, "mhc_fp32_coefficients", CoefficientPrecision.COMPUTE, CoefficientPrecision.ACTIVATION
            ),
            norm_eps=getattr(config, "mhc_norm_eps", 1e-6),
            form=ConnectionForm.SINGLE_PASS
            if getattr(config, "mhc_single_pass", False)
            else ConnectionForm.PER_SUBLAYER,
            use_fused=getattr(config, "use_fused_mhc", False),
            perform_initialization=getattr(config, "perform_initialization", True),
            sequence_parallel=getattr(config, "sequence_parallel", False),
            h_res_constraint=getattr(config, "mhc_h_res_constraint", ResidualConstraint.SINKHORN),
        )


def _flag(config: Any, name: str, on: Any, off: Any) -> Any:
    """A boolean upstream flag as an option: `on` when True, `off` when False, None when absent or None."""
    v = getattr(config, name, None)
    return None if v is None else (on if v else off)


PARAM_DTYPE = torch.float32
"""mHC parameters are kept in fp32."""
