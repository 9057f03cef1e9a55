"""The tile sweep's candidates: per `tiling` key, the tiles, formulations and occupancy hints to time.

`CANDIDATES` is in `KEY_ORDER`; the first candidate of each tile key is the heuristic's choice at
n = 4, C >= 256 (the default a winner must beat). A candidate is a tile object for its key, or a
whole `tiling.overridden` dict (the `*_occupancy` keys: hints, with the heuristic's or given tiles);
`override` turns either into `tiling.overridden` keywords. Timed by `sweep`, compiled ahead of time
by `precompile`, adopted into a tuning by `adopt.from_sweep`. Only formulations the product kernels
have are here; the others are declared in `retired.py`. Why each candidate is here (the resource
report of its compiled kernel, the sweeps it won or lost):
`docs/measurements/h200-2026-11-30/sweep-candidates.md`.
"""

from __future__ import annotations

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.tiling import override

__all__ = ["CANDIDATES", "KEY_ORDER", "override", "tile_key", "directions", "op_of"]

_S = tiling.StreamTiles
_SK = tiling.SinkhornTiles
_M = tiling.MappingTiles
_SLICES, _TUPLE = tiling.StreamLayout.SLICES, tiling.StreamLayout.TUPLE
CANDIDATES: dict[str, tuple] = {
    # Batch-first tiles; per-element (one matrix per thread).
    "sinkhorn": (
        _SK(tile_b=64),
        _SK(tile_b=8),
        _SK(tile_b=32),
        *(_SK(tile_b=b, per_element=True) for b in (32, 64, 128, 256)),
    ),
    # Per-stream slices, with and without the C loop; `mma`: whole tiles in and out by TMA, the stream
    # sum on the tensor cores.
    "h_aggregate_fwd": (
        _S(tile_t=8, tile_c=256, per_stream=_SLICES),
        _S(tile_t=4, tile_c=512, per_stream=_SLICES),
        _S(tile_t=4, tile_c=256, per_stream=_SLICES),
        _S(tile_t=16, tile_c=128, per_stream=_SLICES),
        *(
            _S(tile_t=t, tile_c=c, per_stream=_SLICES, loop_c=True)
            for t, c in ((8, 256), (4, 256), (16, 256), (8, 512))
        ),
        _S(tile_t=8, tile_c=256, mma=True),
        _S(tile_t=8, tile_c=256, loop_c=True, mma=True),
        _S(tile_t=16, tile_c=128, mma=True),
        _S(tile_t=16, tile_c=256, loop_c=True, mma=True),
    ),
    "h_aggregate_bwd": (_S(tile_t=8, tile_c=256), _S(tile_t=4, tile_c=256), _S(tile_t=16, tile_c=256)),
    "h_post_bda_fwd": (
        _S(tile_t=4, tile_c=256, per_stream=_SLICES),
        _S(tile_t=2, tile_c=256, per_stream=_SLICES),
        _S(tile_t=4, tile_c=128, per_stream=_SLICES),
        _S(tile_t=2, tile_c=512, per_stream=_SLICES),
        _S(tile_t=4, tile_c=256, per_stream=_SLICES, loop_c=True),
        *(_S(tile_t=t, tile_c=c, per_stream=_TUPLE) for t, c in ((4, 256), (8, 256), (8, 128))),
        *(
            _S(tile_t=t, tile_c=c, per_stream=_TUPLE, loop_c=True)
            for t, c in ((4, 256), (8, 256), (8, 128), (2, 256))
        ),
    ),
    "h_post_bda_bwd": (
        _S(tile_t=32, tile_c=64),
        _S(tile_t=64, tile_c=32),
        _S(tile_t=16, tile_c=64),
        *(_S(tile_t=t, tile_c=c, per_stream=_TUPLE) for t, c in ((8, 64), (4, 64), (8, 32), (4, 128))),
    ),
    "mapping_fwd": (
        _M(tile_m=64, tile_k=128),
        _M(tile_m=128, tile_k=64),
        _M(tile_m=128, tile_k=128),
        _M(tile_m=64, tile_k=256),
    ),
    # The first is the default; the others compile without spills.
    "mapping_bwd": (
        _M(tile_m=32, tile_k=128),
        _M(tile_m=16, tile_k=64),
        _M(tile_m=64, tile_k=64),
        _M(tile_m=16, tile_k=256),
        _M(tile_m=32, tile_k=32),
        _M(tile_m=32, tile_k=64),
        _M(tile_m=16, tile_k=128),
    ),
    # The pre-op as the mapping, Sinkhorn and aggregate ops in a row (the default), or fused (the aggregate in
    # the mapping's epilogue and backward), under the mapping tiles in force.
    "pre": (tiling.PreTiles(fused=False), tiling.PreTiles(fused=True)),
}


def _hinted(key: str, occupancies: tuple[int, ...], tiles=None) -> tuple[dict, ...]:
    """Override dicts: `key`'s kernels with each occupancy hint, with `tiles` (default: the heuristic's)."""
    base = {} if tiles is None else {key: tiles}
    return tuple({**base, "occupancy": {k: occ for k in tiling.KERNELS_OF[key]}} for occ in occupancies)


for _key in (
    "h_aggregate_fwd",
    "h_aggregate_bwd",
    "h_post_bda_fwd",
    "h_post_bda_bwd",
    "mapping_fwd",
    "mapping_bwd",
    "sinkhorn",
):
    # The same op with its default tiles and the occupancy hint on its kernels (2, 4, 8 CTAs per SM).
    CANDIDATES[f"{_key}_occupancy"] = _hinted(_key, (2, 4, 8))
# Kernels that compile to 255 registers x 256 threads unhinted, at occupancy 2 / 3 / 4: the tuple-of-streams
# h_post_bda backward and the C-looping h_post_bda and h_aggregate forwards.
CANDIDATES["h_post_bda_bwd_occupancy"] += (
    _hinted("h_post_bda_bwd", (2, 3, 4), _S(tile_t=8, tile_c=64, per_stream=_TUPLE))
    + _hinted("h_post_bda_bwd", (4,), _S(tile_t=16, tile_c=64, per_stream=_TUPLE))
    + _hinted("h_post_bda_bwd", (2,), _S(tile_t=4, tile_c=128, per_stream=_TUPLE))
    + _hinted("h_post_bda_bwd", (2,), _S(tile_t=4, tile_c=64, per_stream=_TUPLE))
)
CANDIDATES["h_post_bda_fwd_occupancy"] += _hinted(
    "h_post_bda_fwd", (2, 4), _S(tile_t=4, tile_c=256, per_stream=_TUPLE, loop_c=True)
)
CANDIDATES["h_aggregate_fwd_occupancy"] += _hinted(
    "h_aggregate_fwd", (2, 4), _S(tile_t=8, tile_c=256, loop_c=True, mma=True)
)
# The fused pre-op's kernels with the hint (the forward epilogue compiles to 254 registers unhinted).
CANDIDATES["pre_occupancy"] = _hinted("pre", (2, 4), tiling.PreTiles(fused=True))
# Most expected gain first, so that a sweep its timeout cuts short has timed these: the kernels furthest
# from their targets before the forwards.
KEY_ORDER = (
    "h_post_bda_bwd",
    "mapping_bwd",
    "sinkhorn",
    "pre",
    "h_post_bda_fwd",
    "h_aggregate_fwd",
    "h_post_bda_bwd_occupancy",
    "mapping_bwd_occupancy",
    "pre_occupancy",
    "h_post_bda_fwd_occupancy",
    "h_aggregate_fwd_occupancy",
    "mapping_fwd",
    "mapping_fwd_occupancy",
    "sinkhorn_occupancy",
    "h_aggregate_bwd",
    "h_aggregate_bwd_occupancy",
)
CANDIDATES = {key: CANDIDATES[key] for key in KEY_ORDER}
"""Candidates per `tiling` key (in `KEY_ORDER`): a tile object for that key, or a whole
`tiling.overridden` dict (the `*_occupancy` keys: hints, with the heuristic's or given tiles). The
first candidate of each tile key is the heuristic's choice at n = 4, C >= 256."""


def tile_key(key: str) -> str:
    """The `tiling` key a sweep key drives (`h_aggregate_fwd_occupancy` -> `h_aggregate_fwd`)."""
    return key.removesuffix("_occupancy")


def directions(key: str) -> tuple[str, ...]:
    """The directions (`fwd`, `bwd`) a sweep key's candidates are timed in."""
    return tiling.directions(tile_key(key))


def op_of(key: str) -> str:
    """The mHC op a sweep key times (`mapping_bwd_occupancy` -> `mapping`)."""
    return tile_key(key).removesuffix("_fwd").removesuffix("_bwd")
