"""The backend a `HyperConnectionModule` calls, and its selection."""

from __future__ import annotations

from mhc_core.kernels import dispatch
from mhc_core.ops import REFERENCE, Backend

__all__ = ["select_backend"]


def select_backend(use_fused: bool) -> Backend:
    """The reference backend, or the per-op dispatch (`dispatch.DISPATCH`) when `use_fused`.

    With `use_fused`, the selection is checked once here for the default device, so a bad
    `MHC_BACKEND*` value or a forced unavailable backend fails at construction, not mid-step.
    """
    if not use_fused:
        return REFERENCE
    for op in dispatch.OPS:
        dispatch.resolve(op)
    return dispatch.DISPATCH
