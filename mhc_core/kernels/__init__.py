"""Backends of the mHC ops (`mhc_core.ops.contract.Backend`) behind one dispatch: `reference`, `compiled`
(torch.compile), `cutile`.

Select per op with `MHC_BACKEND` / `MHC_BACKEND_<OP>` (`auto|reference|compiled|cutile`); see
`mhc_core.kernels.dispatch` and `docs/kernels.md`. The backend modules are imported lazily.
"""

from mhc_core.kernels.base import select_backend
from mhc_core.kernels.dispatch import (
    BACKENDS,
    DISPATCH,
    OPS,
    BackendUnavailableError,
    backend_report,
    get_backend,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "DISPATCH",
    "OPS",
    "BackendUnavailableError",
    "backend_report",
    "get_backend",
    "resolve_backend",
    "select_backend",
]
