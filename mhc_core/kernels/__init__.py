"""Backends for the four mHC ops behind one dispatch (`reference` only until the fused kernels land)."""

from mhc_core.kernels.base import REFERENCE_OPS, MHCOps, select_ops

__all__ = ["MHCOps", "REFERENCE_OPS", "select_ops"]
