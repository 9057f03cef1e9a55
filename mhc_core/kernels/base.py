"""The op bundle a `HyperConnectionModule` calls, and its selection."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mhc_core import ops

__all__ = ["MHCOps", "REFERENCE_OPS", "select_ops"]


class MHCOps(NamedTuple):
    """The four mHC ops, each with the signature of its reference in `mhc_core.ops`."""

    sinkhorn: Callable
    mapping: Callable
    h_aggregate: Callable
    h_post_bda: Callable


REFERENCE_OPS = MHCOps(
    sinkhorn=ops.sinkhorn,
    mapping=ops.mapping,
    h_aggregate=ops.h_aggregate,
    h_post_bda=ops.h_post_bda,
)


def select_ops(use_fused: bool) -> MHCOps:
    """`REFERENCE_OPS`, or the fused dispatch when `use_fused`."""
    if not use_fused:
        return REFERENCE_OPS
    raise NotImplementedError("use_fused=True: the fused mHC kernels are not available in this build")
