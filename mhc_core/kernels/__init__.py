"""Backends for the four mHC ops behind one dispatch: `reference`, `compiled` (torch.compile), `cutile`.

Select per op with `MHC_BACKEND` / `MHC_BACKEND_<OP>` (`auto|reference|compiled|cutile`); see
`mhc_core.kernels.dispatch` and `docs/kernels.md`. The backend modules are imported lazily.
"""

from mhc_core.kernels.base import FUSED_OPS, REFERENCE_OPS, MHCOps, select_ops
from mhc_core.kernels.dispatch import (
    BACKENDS,
    OPS,
    BackendUnavailableError,
    backend_report,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "FUSED_OPS",
    "OPS",
    "REFERENCE_OPS",
    "BackendUnavailableError",
    "MHCOps",
    "backend_report",
    "resolve_backend",
    "select_ops",
]
