"""The oracle of each variant or configuration: `mhc_core`'s reference ops in fp64, with a peer's op signatures.

A check runs the peer and the oracle on the same (rounded) inputs and compares outputs and
gradients; the oracle is a `MhcCorePeer` on the reference
backend, fed fp64 copies. `oracle("megatron_dev+eps_inside_sqrt+learned_exit")` is the variant with
those options (`mhc_core.variants`).
"""

from __future__ import annotations

from functools import cache

import torch

from harness.peers.mhc_core_peer import MhcCorePeer
from mhc_core.ops.mapping import NORM_EPS, compute_dtype, effective_norm_eps
from mhc_core.variants import NormEpsPlacement, NumericsOptions, Variant, configure, get_variant

__all__ = ["VARIANT_NAMES", "oracle", "oracle_for"]

VARIANT_NAMES = tuple(v.value for v in Variant)


@cache
def oracle(configuration: str, norm_eps: float = NORM_EPS) -> MhcCorePeer:
    """The fp64 reference of `configuration` (a variant name, or `<variant>+<option>...`)."""
    try:
        name = get_variant(configuration).name
    except ValueError as exc:
        raise ValueError(f"oracle({configuration!r}): {exc}") from None
    return MhcCorePeer(
        name=f"oracle[{name}]",
        variant=name,
        description=f"{name} in fp64",
        ops=frozenset(),
        claims=name,
        norm_eps=norm_eps,
    )


def oracle_for(configuration: str, dtype: torch.dtype) -> MhcCorePeer:
    """The oracle of `configuration` for a check in `dtype`. Under `dtype_eps_inside_sqrt` the eps is the machine
    eps of the dtype the configuration computes its mapping in for `dtype` inputs (fp32 for a bf16 check of an
    fp32 mapping), not fp64's: the oracle is that configuration with `eps_inside_sqrt` and that eps."""
    spec = get_variant(configuration)
    if not spec.norm_eps_from_dtype:
        return oracle(configuration)
    inside = configure(spec, NumericsOptions(norm_eps_placement=NormEpsPlacement.INSIDE_SQRT)).name
    return oracle(inside, effective_norm_eps(spec, NORM_EPS, compute_dtype(spec, dtype)))
