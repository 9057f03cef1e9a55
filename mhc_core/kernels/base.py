"""The op bundle a `HyperConnectionModule` calls, and its selection."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mhc_core import ops
from mhc_core.kernels import dispatch

__all__ = ["MHCOps", "REFERENCE_OPS", "FUSED_OPS", "select_ops"]


class MHCOps(NamedTuple):
    """The mHC ops, each with the signature of its reference in `mhc_core.ops`: the four ops and `pre`
    (mapping, Sinkhorn and aggregate in one call, which `HyperConnectionModule` uses)."""

    sinkhorn: Callable
    mapping: Callable
    h_aggregate: Callable
    h_post_bda: Callable
    pre: Callable


REFERENCE_OPS = MHCOps(
    sinkhorn=ops.sinkhorn,
    mapping=ops.mapping,
    h_aggregate=ops.h_aggregate,
    h_post_bda=ops.h_post_bda,
    pre=ops.pre,
)


FUSED_OPS = MHCOps(
    sinkhorn=dispatch.sinkhorn,
    mapping=dispatch.mapping,
    h_aggregate=dispatch.h_aggregate,
    h_post_bda=dispatch.h_post_bda,
    pre=dispatch.pre,
)
"""The dispatched ops: each call picks its backend per op (`mhc_core.kernels.dispatch`)."""


def select_ops(use_fused: bool) -> MHCOps:
    """`REFERENCE_OPS`, or the per-op dispatch (`FUSED_OPS`) when `use_fused`.

    With `use_fused`, the selection is checked once here for the default device, so a bad
    `MHC_BACKEND*` value or a forced unavailable backend fails at construction, not mid-step.
    """
    if not use_fused:
        return REFERENCE_OPS
    for op in dispatch.OPS:
        dispatch.resolve(op)
    return FUSED_OPS
