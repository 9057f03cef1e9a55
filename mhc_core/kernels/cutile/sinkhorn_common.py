"""What the Sinkhorn kernels and their launch wrapper share, without `cuda.tile`: the variant codes
(the kernels' `VARIANT` constant) and the number of normalisation pairs each variant runs."""

from __future__ import annotations

__all__ = ["PAPER", "MAIN", "DEV", "num_pairs"]

PAPER, MAIN, DEV = 0, 1, 2


def num_pairs(iterations, VARIANT):
    """Pairs of normalisations after the start map: `iterations - 1` for `megatron_dev` (its start
    map ends with a column step), else `iterations`. Called inside the kernels too."""
    if VARIANT == DEV:
        p = iterations - 1
    else:
        p = iterations
    return p
