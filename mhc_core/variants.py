"""The three numeric conventions of mHC, as one enum and one table.

| | `paper` | `megatron_main` | `megatron_dev` |
|---|---|---|---|
| Sinkhorn start | `exp(Z)` | `exp(Z - rowmax)` | `softmax(Z) + eps`, then one column step |
| Sinkhorn step | column then row | row then column, `/ clamp(sum, 1e-6)` | row then column, `/ (sum + eps)` |
| residual mix | `H_res @ x` | `H_res @ x` | `H_res^T @ x` |
| H_pre | `sigmoid` | `sigmoid` | `sigmoid + 1e-6` |
| mapping precision | fp32 | activation dtype | fp32 |
| params under a bf16 / fp16 cast | kept fp32 | cast with the model | kept fp32 |
| norm eps | outside the square root | outside | outside |
| block exit | mean | mean | mean |

Five numerics choices real implementations differ in are named options of any variant
(`NumericsOptions`, `configure`): where the norm's eps sits (`eps_inside_sqrt`: `rsqrt(mean(x^2) + eps)`
as DeepSeek-V4 and Liger; `dtype_eps_inside_sqrt`: the same with the compute dtype's machine eps, as
`F.rms_norm(eps=None)` and TE), the mapping precision (`fp32_mappings` / `activation_mappings`: compute
and parameters in fp32 or in the activation dtype), the block exit (`learned_exit` / `mean_exit`) and
the orientation of the residual mix (`transposed_mix`: `H^T @ x` / `untransposed_mix`: `H @ x`; Liger
mixes dev's H_res untransposed) and the coefficients' dtype (`fp32_coefficients`: kept in the mapping's
compute dtype, fp32 under fp32 mappings, as DeepSeek-V4.1 / `activation_coefficients`: cast to the activation dtype)
and the dtype Sinkhorn iterates in (`input_dtype_sinkhorn`: the logits' own, bf16 logits stay bf16 through every
normalisation, as Megatron Lite / `fp32_sinkhorn`: fp32 at least, every variant's own).
A configured spec is named `<variant>+<option>+...` (`megatron_dev+eps_inside_sqrt+learned_exit`),
listing only the options that differ from the variant's own, and `get_variant` resolves such a name.
A few configurations also have a name of their own (`CONFIGURATIONS`: `deepseek_v41`, DeepSeek-V4.1's numerics),
which `get_variant` resolves too (`deepseek_v41+untransposed_mix` applies an option on top).

The full list of differences is in `docs/variants.md`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Literal

__all__ = [
    "CONFIGURATIONS",
    "CoefficientPrecision",
    "MappingPrecision",
    "NormEpsPlacement",
    "NumericsOptions",
    "OutputContraction",
    "ResidualConstraint",
    "ResidualMix",
    "SinkhornPrecision",
    "Variant",
    "VariantSpec",
    "VARIANTS",
    "configure",
    "configuration_name",
    "get_variant",
]


class Variant(enum.StrEnum):
    """A named numeric convention of mHC (a `StrEnum`: `str()` gives "paper", as ids and messages need)."""

    PAPER = "paper"
    MEGATRON_MAIN = "megatron_main"
    MEGATRON_DEV = "megatron_dev"

    @property
    def tag(self) -> str:
        """The short name in kernel launch labels and test ids: `paper`, `main`, `dev`."""
        return self.value.removeprefix("megatron_")


class ResidualConstraint(enum.StrEnum):
    """How H_res is formed from its logits."""

    SINKHORN = "sinkhorn"
    """mHC: Sinkhorn-Knopp onto (approximately) doubly stochastic matrices."""
    NONE = "none"
    """Unconstrained Hyper-Connections, the HC paper's dynamic form: `H_res = I + logits` (identity at
    init, then whatever training makes of it). The baseline the mHC paper's stability figure compares."""
    PERMUTATIONS = "permutations"
    """mHC-lite (MaxText's `enable_mhc_lite`): `H_res = sum_p softmax(logits)_p P_p` over the n! permutation
    matrices, exactly doubly stochastic without iterations; the projection has `2n + n!` outputs
    (`mhc_core.ops.permutations`)."""


class NormEpsPlacement(enum.StrEnum):
    """Where the eps of the mapping's RMS norm sits."""

    OUTSIDE_SQRT = "outside_sqrt"
    """`r = 1 / (sqrt(mean(x^2)) + eps)`: upstream Megatron-LM main and dev, the paper."""
    INSIDE_SQRT = "inside_sqrt"
    """`r = rsqrt(mean(x^2) + eps)`: DeepSeek-V4, Liger-Kernel, TileKernels (#7521's
    `mhc_norm_eps_inside_sqrt`)."""
    INSIDE_SQRT_DTYPE_EPS = "inside_sqrt_dtype_eps"
    """`r = rsqrt(mean(x^2) + finfo(compute dtype).eps)`, whatever eps is configured: `F.rms_norm(...,
    eps=None)`, an `nn.RMSNorm` built without eps, TE's Triton mHC (fp32: 1.19e-7)."""


class MappingPrecision(enum.StrEnum):
    """The dtype the mapping (projection, RMS, coefficients) computes in, and its parameters' dtype."""

    FP32 = "fp32"
    """Upcast to fp32; parameters stay fp32 under a half-precision cast (#7521's `mhc_keep_mappings_in_fp32`)."""
    ACTIVATION = "activation"
    """The activation dtype; parameters are cast with the model."""


class OutputContraction(enum.StrEnum):
    """How the block exit folds the n streams back to one."""

    MEAN = "mean"
    """The mean of the streams."""
    LEARNED = "learned"
    """The learned contraction `hc_head_fn / hc_head_base / hc_head_scale` (upstream dev's
    `learned_output_contract`, DeepSeek-V4's `hc_head`)."""


class ResidualMix(enum.StrEnum):
    """How H_res mixes the streams."""

    UNTRANSPOSED = "untransposed"
    """`out_i = sum_j H[i, j] x_j` (`H @ x`): upstream main, the paper, Liger-Kernel."""
    TRANSPOSED = "transposed"
    """`out_i = sum_j H[j, i] x_j` (`H^T @ x`): upstream dev, DeepSeek-V4."""


class CoefficientPrecision(enum.StrEnum):
    """The dtype the coefficients (`h_pre`, `h_post`, the residual logits and so Sinkhorn's input) leave the
    mapping in."""

    ACTIVATION = "activation"
    """Cast to the activation dtype: upstream main and dev (Sinkhorn then iterates on rounded logits)."""
    COMPUTE = "compute"
    """Kept in the mapping's compute dtype (fp32 under fp32 mappings): the paper, DeepSeek-V4.1's reference
    (`SinglePassHyperConnection` keeps "the FP32 coefficients used by DeepSeek")."""


class SinkhornPrecision(enum.StrEnum):
    """The dtype Sinkhorn iterates in."""

    FP32 = "fp32"
    """fp32 at least (fp64 stays fp64), rounded once to the logits' dtype at the end: every variant's own."""
    INPUT = "input"
    """The logits' own dtype: bf16 logits are normalised in bf16 at every step (Megatron Lite's `hca.py`)."""


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
    params_fp32: bool
    """mHC parameters stay fp32 when the model is cast to fp16 / bf16 (`mhc_core.precision`)."""
    norm_eps_placement: NormEpsPlacement = NormEpsPlacement.OUTSIDE_SQRT
    """Where the RMS norm's eps sits (an option: `configure`)."""
    output_contraction: OutputContraction = OutputContraction.MEAN
    """The block exit (an option: `configure`)."""
    sinkhorn_precision: SinkhornPrecision = SinkhornPrecision.FP32
    """The dtype Sinkhorn iterates in (an option: `configure`)."""

    def __post_init__(self) -> None:
        if self.sinkhorn_start == "exp" and self.sinkhorn_guard != "none":
            raise ValueError(
                f"VariantSpec {self.variant.value}: sinkhorn_start='exp' runs in the log domain, which has "
                f"no sum to guard; sinkhorn_guard={self.sinkhorn_guard!r} needs a linear start"
            )
        if self.sinkhorn_start == "softmax_eps" and self.sinkhorn_order != "row_col":
            raise ValueError(
                f"VariantSpec {self.variant.value}: sinkhorn_start='softmax_eps' is the first row step, "
                f"so sinkhorn_order must be 'row_col', got {self.sinkhorn_order!r}"
            )

    @property
    def sinkhorn_form(self) -> tuple[str, str, str]:
        """`(start, order, guard)`: what a Sinkhorn kernel computes (eps and iterations are its arguments)."""
        return (self.sinkhorn_start, self.sinkhorn_order, self.sinkhorn_guard)

    @property
    def mapping_precision(self) -> MappingPrecision:
        """`fp32` when the mapping computes (and keeps its parameters) in fp32."""
        return MappingPrecision.FP32 if self.mapping_fp32 else MappingPrecision.ACTIVATION

    @property
    def coefficient_precision(self) -> CoefficientPrecision:
        """`activation` when the coefficients are cast to the activation dtype."""
        return (
            CoefficientPrecision.ACTIVATION
            if self.coefficients_in_activation_dtype
            else CoefficientPrecision.COMPUTE
        )

    @property
    def residual_mix(self) -> ResidualMix:
        """`transposed` when the mix is `H^T @ x`."""
        return ResidualMix.TRANSPOSED if self.res_transposed else ResidualMix.UNTRANSPOSED

    @property
    def options(self) -> tuple[str, ...]:
        """The option names where this spec differs from its variant's own, in `_OPTION_NAMES`' order."""
        base = VARIANTS[self.variant]
        rest = [
            f.name
            for f in fields(self)
            if f.name not in _OPTION_FIELDS and getattr(self, f.name) != getattr(base, f.name)
        ]
        if rest:
            raise ValueError(
                f"VariantSpec differs from {self.variant.value} in {', '.join(rest)}, which are not "
                f"options; options: {', '.join(_OPTION_NAMES)}"
            )
        return tuple(
            name
            for name, (field, value) in _OPTION_NAMES.items()
            if getattr(self, field) == value != getattr(base, field)
        )

    @property
    def name(self) -> str:
        """`<variant>[+<option>...]`, e.g. `megatron_dev+eps_inside_sqrt`; resolvable by `get_variant`."""
        return "+".join((self.variant.value, *self.options))

    @property
    def norm_eps_inside(self) -> bool:
        """Whether the eps goes in `sqrt(mean(x^2) + eps)` (True) or in `1 / (rms + eps)` (False)."""
        return self.norm_eps_placement in (
            NormEpsPlacement.INSIDE_SQRT,
            NormEpsPlacement.INSIDE_SQRT_DTYPE_EPS,
        )

    @property
    def sinkhorn_in_input_dtype(self) -> bool:
        """Whether Sinkhorn iterates in the logits' own dtype (`input_dtype_sinkhorn`)."""
        return self.sinkhorn_precision == SinkhornPrecision.INPUT

    @property
    def norm_eps_from_dtype(self) -> bool:
        """Whether the eps is the machine eps of the mapping's compute dtype rather than the configured one."""
        return self.norm_eps_placement == NormEpsPlacement.INSIDE_SQRT_DTYPE_EPS


@dataclass(frozen=True, kw_only=True)
class NumericsOptions:
    """The named options of a variant; None keeps the variant's own choice."""

    norm_eps_placement: NormEpsPlacement | None = None
    mapping_precision: MappingPrecision | None = None
    output_contraction: OutputContraction | None = None
    residual_mix: ResidualMix | None = None
    coefficient_precision: CoefficientPrecision | None = None
    sinkhorn_precision: SinkhornPrecision | None = None

    def __post_init__(self) -> None:
        for name, kind in OPTION_KINDS.items():
            v = getattr(self, name)
            if v is None:
                continue
            try:
                object.__setattr__(self, name, kind(v))
            except ValueError:
                raise ValueError(
                    f"NumericsOptions.{name}={v!r}: valid: {', '.join(k.value for k in kind)}"
                ) from None


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
        params_fp32=True,
    ),
}


OPTION_KINDS: dict[str, type[enum.StrEnum]] = {
    "norm_eps_placement": NormEpsPlacement,
    "mapping_precision": MappingPrecision,
    "output_contraction": OutputContraction,
    "residual_mix": ResidualMix,
    "coefficient_precision": CoefficientPrecision,
    "sinkhorn_precision": SinkhornPrecision,
}
"""Each option (a `NumericsOptions` field, and a `VariantSpec` field or property) and its choices."""

_OPTION_FIELDS = (
    "norm_eps_placement",
    "mapping_fp32",
    "params_fp32",
    "output_contraction",
    "res_transposed",
    "coefficients_in_activation_dtype",
    "sinkhorn_precision",
)
"""The `VariantSpec` fields the options set (`mapping_precision` sets the two precision fields)."""

_OPTION_NAMES: dict[str, tuple[str, str]] = {
    "eps_inside_sqrt": ("norm_eps_placement", NormEpsPlacement.INSIDE_SQRT),
    "eps_outside_sqrt": ("norm_eps_placement", NormEpsPlacement.OUTSIDE_SQRT),
    "dtype_eps_inside_sqrt": ("norm_eps_placement", NormEpsPlacement.INSIDE_SQRT_DTYPE_EPS),
    "fp32_mappings": ("mapping_precision", MappingPrecision.FP32),
    "activation_mappings": ("mapping_precision", MappingPrecision.ACTIVATION),
    "learned_exit": ("output_contraction", OutputContraction.LEARNED),
    "mean_exit": ("output_contraction", OutputContraction.MEAN),
    "transposed_mix": ("residual_mix", ResidualMix.TRANSPOSED),
    "untransposed_mix": ("residual_mix", ResidualMix.UNTRANSPOSED),
    "fp32_coefficients": ("coefficient_precision", CoefficientPrecision.COMPUTE),
    "activation_coefficients": ("coefficient_precision", CoefficientPrecision.ACTIVATION),
    "input_dtype_sinkhorn": ("sinkhorn_precision", SinkhornPrecision.INPUT),
    "fp32_sinkhorn": ("sinkhorn_precision", SinkhornPrecision.FP32),
}
"""Each option's name in a configuration name, and the `NumericsOptions` field and value it sets."""


def configure(variant: str | Variant | VariantSpec, options: NumericsOptions | None = None) -> VariantSpec:
    """`variant` with `options` applied (None fields keep the variant's choice)."""
    spec = get_variant(variant)
    if options is None:
        return spec
    changes: dict = {}
    if options.norm_eps_placement is not None:
        changes["norm_eps_placement"] = options.norm_eps_placement
    if options.mapping_precision is not None:
        fp32 = options.mapping_precision == MappingPrecision.FP32
        changes["mapping_fp32"] = changes["params_fp32"] = fp32
    if options.output_contraction is not None:
        changes["output_contraction"] = options.output_contraction
    if options.residual_mix is not None:
        changes["res_transposed"] = options.residual_mix == ResidualMix.TRANSPOSED
    if options.coefficient_precision is not None:
        changes["coefficients_in_activation_dtype"] = (
            options.coefficient_precision == CoefficientPrecision.ACTIVATION
        )
    if options.sinkhorn_precision is not None:
        changes["sinkhorn_precision"] = options.sinkhorn_precision
    out = replace(spec, **changes)
    return VARIANTS[out.variant] if out == VARIANTS[out.variant] else out


def _with_options(spec: VariantSpec, name: str, options: list[str]) -> VariantSpec:
    """`spec` with the options named in `name` (`<variant>+<option>...`) applied."""
    chosen: dict[str, str] = {}
    for opt in options:
        if opt not in _OPTION_NAMES:
            raise ValueError(f"variant={name!r}: unknown option {opt!r}; options: {', '.join(_OPTION_NAMES)}")
        field_name, _ = _OPTION_NAMES[opt]
        if field_name in chosen:
            raise ValueError(f"variant={name!r}: {chosen[field_name]!r} and {opt!r} set the same option")
        chosen[field_name] = opt
    return configure(spec, NumericsOptions(**{f: _OPTION_NAMES[o][1] for f, o in chosen.items()}))


def get_variant(variant: str | Variant | VariantSpec) -> VariantSpec:
    """Return the spec of `variant` (a variant, or a configuration name `<variant>+<option>...`);
    `ValueError` naming the argument for an unknown name or option."""
    if isinstance(variant, VariantSpec):
        return variant
    base, *options = variant.split("+") if isinstance(variant, str) else (variant,)
    if isinstance(base, str) and base in CONFIGURATIONS:
        spec = get_variant(CONFIGURATIONS[base])
        return _with_options(spec, variant, options) if options else spec
    try:
        spec = VARIANTS[Variant(base)]
    except ValueError:
        valid = ", ".join(v.value for v in Variant)
        raise ValueError(
            f"variant={variant!r} is not a known mHC variant; valid: {valid}, or a named configuration "
            f"({', '.join(CONFIGURATIONS)}) (options, as '+<option>': {', '.join(_OPTION_NAMES)})"
        ) from None
    return _with_options(spec, variant, options) if options else spec


CONFIGURATIONS: dict[str, str] = {
    "deepseek_v41": "megatron_dev+eps_inside_sqrt+fp32_coefficients",
}
"""Configurations with a name of their own, and what they are. `deepseek_v41`: DeepSeek-V4.1's numerics as
upstream's reference path computes them (`megatron/core/transformer/single_pass_mhc.py`): dev's Sinkhorn,
`sigmoid + eps` and transposed mix, the RMS factor `rsqrt(mean(x^2) + eps)` (with the model's RMS epsilon: a
config value, `norm_eps`), every coefficient kept fp32 into Sinkhorn and the fp32 mixes. It names numerics only:
the single-pass data flow is a form (`mhc_core.forms`), which any configuration can run."""


def configuration_name(variant: str | Variant | VariantSpec) -> str:
    """The name of a configuration as reports print it: its own name when it has one (`deepseek_v41`), else
    `<variant>[+<option>...]`."""
    spec = get_variant(variant)
    for name, value in CONFIGURATIONS.items():
        if get_variant(value) == spec:
            return name
    return spec.name
