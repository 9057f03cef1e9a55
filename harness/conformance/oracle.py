"""The oracle of each variant or configuration: `mhc_core`'s reference ops in fp64, with a peer's op signatures.

A check runs the peer and the oracle on the same (rounded) inputs and compares outputs and
gradients; the oracle is a `MhcCorePeer` on the reference
backend, fed fp64 copies. `oracle("megatron_dev+eps_inside_sqrt+learned_exit")` is the variant with
those options (`mhc_core.variants`).
"""

from __future__ import annotations

from functools import cache

from harness.peers.mhc_core_peer import MhcCorePeer
from mhc_core.variants import get_variant

__all__ = ["VARIANT_NAMES", "oracle"]

VARIANT_NAMES = ("paper", "megatron_main", "megatron_dev")


@cache
def oracle(configuration: str) -> MhcCorePeer:
    """The fp64 reference of `configuration` (a variant name, or `<variant>+<option>...`)."""
    try:
        name = get_variant(configuration).name
    except ValueError as exc:
        raise ValueError(f"oracle({configuration!r}): {exc}") from None
    return MhcCorePeer(name=f"oracle[{name}]", variant=name, description=f"{name} in fp64",
                       ops=frozenset(), claims=name)
