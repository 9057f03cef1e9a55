"""The oracle of each variant: ``mhc_core``'s reference ops in fp64, with the same op signatures as a peer.

A check runs the peer and the oracle on the same (rounded) inputs and compares outputs and
gradients; the oracle is a :class:`~harness.peers.mhc_core_peer.MhcCorePeer` on the reference
backend, fed fp64 copies.
"""

from __future__ import annotations

from functools import cache

from harness.peers.mhc_core_peer import MhcCorePeer

__all__ = ["VARIANT_NAMES", "oracle"]

VARIANT_NAMES = ("paper", "megatron_main", "megatron_dev")


@cache
def oracle(variant: str) -> MhcCorePeer:
    """The fp64 reference of ``variant``."""
    if variant not in VARIANT_NAMES:
        raise ValueError(f"variant={variant!r} is not one of {', '.join(VARIANT_NAMES)}")
    return MhcCorePeer(name=f"oracle[{variant}]", variant=variant, description=f"{variant} in fp64",
                       ops=frozenset(), claims=variant)
