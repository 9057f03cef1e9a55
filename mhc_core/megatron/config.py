"""`MHCTransformerConfig`: megatron-core's `TransformerConfig` plus the mHC fields of upstream main.

Field names follow upstream Megatron-LM main, so CLI flags generated from the dataclass
(`--enable-mhc-connections`, `--mhc-num-residual-streams`, ...) and configs carry over.
Validation follows upstream main with one deliberate difference: pipeline parallelism is allowed
(expansion / contraction are keyed on `pre_process` / `post_process`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig

from mhc_core.checks import as_int
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = ["MHCTransformerConfig"]


def _bad(field: str, value: Any, rule: str) -> str:
    return f"MHCTransformerConfig.{field}={value!r}: {rule}"


def _is_int(v: Any) -> bool:
    """An integer (NumPy integers too), not a bool."""
    return as_int(v) is not None


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """`TransformerConfig` with mHC (Manifold-Constrained Hyper-Connections).

    A dataclass subclass: construct it exactly like `TransformerConfig`, with the extra keywords
    below. The field values are checked always; the compatibility rules only when
    `enable_mhc_connections` is True. `ValueError` for a bad value, `NotImplementedError` for a
    combination mHC does not support; every message names the field and its value.
    """

    enable_mhc_connections: bool = False
    """Master switch: the residual stream becomes n streams `[s, b, n*C]` between the block ends."""
    mhc_num_residual_streams: int = 4
    """n, the number of residual streams (>= 1)."""
    mhc_sinkhorn_iterations: int = 20
    """Sinkhorn-Knopp iterations for H_res (>= 1)."""
    mhc_init_gating_factor: float = 0.01
    """Initial value of `alpha_pre`, `alpha_post`, `alpha_res` (>= 0)."""
    mhc_variant: str = Variant.MEGATRON_MAIN.value
    """Numeric convention: `paper`, `megatron_main` (upstream main) or `megatron_dev`."""
    mhc_h_res_constraint: str = "sinkhorn"
    """`sinkhorn` (mHC) or `none`: unconstrained Hyper-Connections, `H_res = I + logits` (no upstream
    equivalent: the baseline of the paper's stability figure)."""
    use_fused_mhc: bool = False
    """Route the mHC ops through `mhc_core.kernels` (requires `enable_mhc_connections`)."""
    mhc_learned_contraction: bool = False
    """Block exit with the learned contraction (`hc_head_fn/base/scale`) instead of the mean (the option
    `learned_exit`; upstream dev's default, #7521's `mhc_learned_output_contract`)."""
    mhc_norm_eps_inside_sqrt: bool = False
    """The mapping's RMS norm as `rsqrt(mean(x^2) + eps)` (the option `eps_inside_sqrt`, as DeepSeek-V4;
    upstream PR #7521's name) instead of `1 / (rms + eps)`."""
    mhc_keep_mappings_in_fp32: bool | None = None
    """The mapping computed, and its parameters kept, in fp32 (True) or in the activation dtype (False);
    None: the variant's (fp32 for `paper` and `megatron_dev`). Upstream PR #7521's name."""
    mhc_recompute_layer_num: int | None = None
    """With `"mhc"` in `recompute_modules`: layers per recompute group (None: the whole chunk)."""
    mhc_single_pass: bool = False
    """The single-pass form (DeepSeek-V4.1, upstream main's name): each sublayer aggregates with the H_pre its
    predecessor produced, the entry reads stream 0, the exit aggregates with the last H_pre; the mix travels
    behind the streams (`mhc_core.handoff`). Not with MTP (`mtp_num_layers`) or a learned exit."""
    mhc_fp32_coefficients: bool | None = None
    """The coefficients kept in the mapping's fp32 into Sinkhorn and the mixes (True, the option `fp32_coefficients`,
    as DeepSeek-V4.1) or cast to the activation dtype (False); None: the variant's."""
    mhc_norm_eps: float = 1e-6
    """eps of the mapping's RMS factor (upstream's name; DeepSeek-V4.1 uses the model's RMS epsilon)."""
    mhc_handoff_precision: str = "exact"
    """Single-pass: how the H_pre crosses a pipeline stage boundary: `exact` (its own dtype, the pipelined run is
    the single process's arithmetic) or `pipeline_dtype` (rounded to the pipeline dtype, upstream
    `DSv41HybridStack`'s packing; `mhc_core.handoff.HandoffPrecision`)."""

    def __post_init__(self) -> None:
        for field in (
            "enable_mhc_connections",
            "use_fused_mhc",
            "mhc_learned_contraction",
            "mhc_norm_eps_inside_sqrt",
            "mhc_keep_mappings_in_fp32",
            "mhc_single_pass",
            "mhc_fp32_coefficients",
        ):
            v = getattr(self, field)
            if not isinstance(v, bool) and not (
                v is None and field in ("mhc_keep_mappings_in_fp32", "mhc_fp32_coefficients")
            ):
                # "False" is truthy: it would switch the feature on
                raise ValueError(_bad(field, v, "must be True or False"))
        modules = self.recompute_modules
        if modules is not None and (
            not isinstance(modules, list | tuple) or not all(isinstance(m, str) for m in modules)
        ):
            raise ValueError(
                _bad("recompute_modules", modules, "must be a list of module names, e.g. ['mhc']")
            )
        if self.enable_mhc_connections is True and getattr(self, "overlap_moe_expert_parallel_comm", False):
            # before megatron's own checks, which would ask for EP and bf16 first
            raise NotImplementedError(
                _bad(
                    "overlap_moe_expert_parallel_comm",
                    True,
                    "the a2a-overlap schedule splits a layer into nodes of its "
                    "own, none for mHC's n-stream update; not supported with enable_mhc_connections=True",
                )
            )
        # megatron-core 0.16.1 / 0.19.2 validate recompute_modules against their own list, which
        # lacks upstream main's "mhc": take it out for the base validation, put it back after.
        lists_mhc = self._lists_mhc
        if lists_mhc:
            self.recompute_modules: list[str] = [m for m in modules if m != "mhc"]
        try:
            super().__post_init__()
        except AssertionError as exc:  # megatron's own list of modules lacks upstream main's "mhc"
            if "Invalid choices for recompute_modules" not in str(exc):
                raise
            raise ValueError(_bad("recompute_modules", modules, f"{exc}, and 'mhc'")) from None
        if lists_mhc:
            self.recompute_modules = [*self.recompute_modules, "mhc"]
        self._validate_mhc_values()
        if self.enable_mhc_connections:
            self._validate_mhc_compatibility()
        else:
            for field in (
                "use_fused_mhc",
                "mhc_learned_contraction",
                "mhc_norm_eps_inside_sqrt",
                "mhc_single_pass",
            ):
                if getattr(self, field):
                    raise ValueError(
                        _bad(field, getattr(self, field), "requires enable_mhc_connections=True")
                    )
            if self._lists_mhc:
                raise ValueError(
                    _bad(
                        "recompute_modules",
                        self.recompute_modules,
                        "'mhc' requires enable_mhc_connections=True",
                    )
                )
        if self.mhc_recompute_layer_num is not None and not self.mhc_recompute:
            raise ValueError(
                _bad(
                    "mhc_recompute_layer_num",
                    self.mhc_recompute_layer_num,
                    "needs 'mhc' in recompute_modules with recompute_granularity='selective'",
                )
            )

    @property
    def _lists_mhc(self) -> bool:
        """`"mhc"` is in `recompute_modules` (whatever the granularity)."""
        return "mhc" in (self.recompute_modules or [])

    @property
    def mhc_recompute(self) -> bool:
        """Whether mHC recompute is on: `"mhc"` in `recompute_modules` under selective recompute."""
        return self.recompute_granularity == "selective" and self._lists_mhc

    def _validate_mhc_values(self) -> None:
        for field in ("mhc_num_residual_streams", "mhc_sinkhorn_iterations"):
            v = getattr(self, field)
            iv = as_int(v)
            if iv is None or iv < 1:
                raise ValueError(_bad(field, v, "must be an integer >= 1"))
            setattr(self, field, iv)  # a NumPy integer becomes an int
        eps = self.mhc_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(_bad("mhc_norm_eps", eps, "must be a finite number >= 0"))
        g = self.mhc_init_gating_factor
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(_bad("mhc_init_gating_factor", g, "must be a finite number >= 0"))
        k = self.mhc_recompute_layer_num
        ik = None if k is None else as_int(k)
        if k is not None and (ik is None or ik < 1):
            raise ValueError(_bad("mhc_recompute_layer_num", k, "must be None or an integer >= 1"))
        self.mhc_recompute_layer_num = ik
        try:
            spec = get_variant(self.mhc_variant)
        except (ValueError, TypeError):
            valid = ", ".join(v.value for v in Variant)
            raise ValueError(_bad("mhc_variant", self.mhc_variant, f"valid: {valid}")) from None
        if spec.options:
            raise ValueError(
                _bad(
                    "mhc_variant",
                    self.mhc_variant,
                    "name the variant alone and set its options with mhc_norm_eps_inside_sqrt, "
                    "mhc_keep_mappings_in_fp32, mhc_fp32_coefficients and mhc_learned_contraction",
                )
            )
        self.mhc_variant = spec.variant.value
        from mhc_core.handoff import HandoffPrecision

        try:
            self.mhc_handoff_precision = HandoffPrecision(self.mhc_handoff_precision).value
        except ValueError:
            raise ValueError(
                _bad(
                    "mhc_handoff_precision",
                    self.mhc_handoff_precision,
                    f"valid: {', '.join(h.value for h in HandoffPrecision)}",
                )
            ) from None
        if self.mhc_handoff_precision != HandoffPrecision.EXACT and not self.mhc_single_pass:
            raise ValueError(
                _bad(
                    "mhc_handoff_precision",
                    self.mhc_handoff_precision,
                    "is a single-pass setting (mhc_single_pass=True)",
                )
            )
        if self.mhc_h_res_constraint not in ("sinkhorn", "none"):
            raise ValueError(_bad("mhc_h_res_constraint", self.mhc_h_res_constraint, "valid: sinkhorn, none"))

    def _validate_mhc_compatibility(self) -> None:
        on = "with enable_mhc_connections=True"
        if not _is_int(self.hidden_size) or self.hidden_size < 1:
            raise ValueError(_bad("hidden_size", self.hidden_size, f"must be an integer >= 1 {on}"))
        if self.fp32_residual_connection:
            raise NotImplementedError(_bad("fp32_residual_connection", True, f"not supported {on}"))
        if self.recompute_granularity == "full" and not self.mhc_single_pass:
            raise NotImplementedError(
                _bad(
                    "recompute_granularity",
                    "full",
                    f"full recompute is not supported {on} in the per-sublayer form (as "
                    "upstream main); use 'selective', or mhc_single_pass=True, whose handoff travels through the "
                    "checkpoints",
                )
            )
        if self.mhc_single_pass:
            self._validate_single_pass()
        if getattr(self, "inference_fuse_tp_communication", False):
            raise NotImplementedError(_bad("inference_fuse_tp_communication", True, f"not supported {on}"))
        if getattr(self, "fine_grained_activation_offloading", False):
            raise NotImplementedError(_bad("fine_grained_activation_offloading", True, f"not supported {on}"))
        if self._lists_mhc:
            if self.recompute_granularity != "selective":
                raise ValueError(
                    _bad(
                        "recompute_modules",
                        self.recompute_modules,
                        f"'mhc' needs recompute_granularity='selective', got {self.recompute_granularity!r}",
                    )
                )
            if "mlp" in self.recompute_modules:
                raise ValueError(
                    _bad(
                        "recompute_modules",
                        self.recompute_modules,
                        "'mhc' cannot be combined with 'mlp' (as upstream main)",
                    )
                )

    def _validate_single_pass(self) -> None:
        on = "with mhc_single_pass=True"
        if getattr(self, "mtp_num_layers", None):
            raise NotImplementedError(
                _bad(
                    "mtp_num_layers",
                    self.mtp_num_layers,
                    f"multi-token prediction is not defined {on}: DeepSeek-V4.1 "
                    "publishes no MTP form for the single-pass handoff (which H_pre an MTP depth's first sublayer "
                    "aggregates with, and whether its exit keeps a learned head) and upstream's DSv41HybridStack refuses "
                    "MTP layers as out of scope; the suite refuses it rather than define a contract nobody can check",
                )
            )
        if self.mhc_learned_contraction:
            raise ValueError(
                _bad(
                    "mhc_learned_contraction",
                    True,
                    f"{on} the exit aggregates with the last H_pre; there is no learned exit head",
                )
            )
        if self.mhc_h_res_constraint != "sinkhorn":
            raise ValueError(
                _bad("mhc_h_res_constraint", self.mhc_h_res_constraint, f"{on} needs 'sinkhorn'")
            )

    @property
    def mhc_numerics(self) -> VariantSpec:
        """The variant with its options (`.name`, e.g. `megatron_dev+eps_inside_sqrt+learned_exit`)."""
        from mhc_core.config import HyperConnectionConfig

        return HyperConnectionConfig.from_transformer_config(self).numerics
