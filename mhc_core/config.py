"""`HyperConnectionConfig`: the settings of one `HyperConnectionModule`, megatron-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mhc_core.ops._checks import as_int
from mhc_core.variants import ResidualConstraint, Variant, get_variant

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
    """Numeric convention: `paper`, `megatron_main` or `megatron_dev`."""
    norm_eps: float = 1e-6
    """eps added to the RMS of the mapping (outside the square root)."""
    use_fused: bool = False
    """Route the ops through `mhc_core.kernels` (upstream `use_fused_mhc`)."""
    perform_initialization: bool = True
    """Initialise `mapping_proj.weight` with xavier-uniform (else leave it zero)."""
    sequence_parallel: bool = False
    """Tag the parameters `sequence_parallel=True` so Megatron all-reduces their grads over TP."""
    h_res_constraint: ResidualConstraint = ResidualConstraint.SINKHORN
    """`sinkhorn` (mHC) or `none`: unconstrained Hyper-Connections, `H_res = I + logits` (the baseline of
    the paper's stability comparison)."""

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
            object.__setattr__(self, "variant", get_variant(self.variant).variant)
        except ValueError:
            raise bad("variant", self.variant, f"valid: {', '.join(v.value for v in Variant)}") from None
        try:
            object.__setattr__(self, "h_res_constraint", ResidualConstraint(self.h_res_constraint))
        except ValueError:
            raise bad("h_res_constraint", self.h_res_constraint,
                      f"valid: {', '.join(c.value for c in ResidualConstraint)}") from None

    @property
    def num_mapping_outputs(self) -> int:
        """N = n*n + 2n."""
        return self.num_residual_streams**2 + 2 * self.num_residual_streams

    @classmethod
    def from_transformer_config(cls, config: Any) -> HyperConnectionConfig:
        """Read the upstream field names off a megatron-core `TransformerConfig` (or any object)."""
        return cls(
            hidden_size=config.hidden_size,
            num_residual_streams=getattr(config, "mhc_num_residual_streams", 4),
            sinkhorn_iterations=getattr(config, "mhc_sinkhorn_iterations", 20),
            init_gating_factor=getattr(config, "mhc_init_gating_factor", 0.01),
            variant=getattr(config, "mhc_variant", Variant.MEGATRON_MAIN),
            use_fused=getattr(config, "use_fused_mhc", False),
            perform_initialization=getattr(config, "perform_initialization", True),
            sequence_parallel=getattr(config, "sequence_parallel", False),
            h_res_constraint=getattr(config, "mhc_h_res_constraint", ResidualConstraint.SINKHORN),
        )


PARAM_DTYPE = torch.float32
"""mHC parameters are kept in fp32."""
