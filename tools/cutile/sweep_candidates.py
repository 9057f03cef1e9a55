"""The tile sweep's candidates: per `tiling` key, the tiles, formulations and occupancy hints to time.

`CANDIDATES` is in `KEY_ORDER`; the first candidate of each tile key is the heuristic's choice at
n = 4, C >= 256 (the default a winner must beat). A candidate is a tile object for its key, or a
whole `tiling.overridden` dict (the `*_occupancy` keys: hints, with the heuristic's or given tiles);
`override` turns either into `tiling.overridden` keywords. Timed by `sweep`, compiled ahead of time
by `precompile`, adopted into a tuning by `adopt.from_sweep`.
"""

from __future__ import annotations

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.tiling import override

__all__ = ["CANDIDATES", "KEY_ORDER", "override", "tile_key", "directions", "op_of"]

_S = tiling.StreamTiles
CANDIDATES: dict[str, tuple] = {
    # Sinkhorn: on the H200 (11-30) the batch-last 256, batch-last recompute 128, per-element 256 and
    # per-element IEEE recompute tiles lost by 5-17x (left out). The checkpointed backwards
    # (`checkpoint`; sm_90 at the sweep's shape, `resources --sweep --keys sinkhorn`): 64 x every 4th 255
    # registers and a 24 B stack (5 spill stores), every 2nd 229, 128 x every 3rd 254, 32 x every 2nd 220
    # (256 threads), no other spills; 2 CTAs per SM (32: 1). The per-element stored / recomputing: 112-136.
    # With the forward's checkpoints kept (`fwd_checkpoints`) the backward skips its forward walk: 208 / 184
    # registers at every 4th / 2nd, no spills; that forward 128 / 224.
    "sinkhorn": (tiling.SinkhornTiles(64), tiling.SinkhornTiles(8), tiling.SinkhornTiles(32, True),
                 tiling.SinkhornTiles(64, True), tiling.SinkhornTiles(128, True),
                 tiling.SinkhornTiles(64, True, True),
                 tiling.SinkhornTiles(64, per_element=True), tiling.SinkhornTiles(128, per_element=True),
                 *(tiling.SinkhornTiles(b, per_element=True, approx_div=True) for b in (32, 64, 128)),
                 tiling.SinkhornTiles(128, recompute=True, per_element=True, approx_div=True),
                 *(tiling.SinkhornTiles(b, per_element=True, approx_div=True, checkpoint=k)
                   for b, k in ((64, 4), (64, 2), (128, 3), (32, 2))),
                 *(tiling.SinkhornTiles(64, per_element=True, approx_div=True, checkpoint=k, fwd_checkpoints=True)
                   for k in (4, 2))),
    # `mma` forwards: whole tiles in and out by TMA, the stream sum on the tensor cores (sm_90: 8-9 TMA
    # loads, 2-4 TMA stores, no shuffles, 0-8 shared loads / stores, no spills; the per-stream
    # defaults: 16-26 plain loads, h_post_bda 88 shared stores).
    "h_aggregate_fwd": (_S(8, 256, True), _S(4, 512, True), _S(4, 256, True), _S(16, 128, True), _S(2, 512),
                        _S(8, 256, True, True), _S(4, 256, True, True), _S(16, 256, True, True), _S(8, 512, True, True),
                        _S(8, 256, mma=True), _S(8, 256, loop_c=True, mma=True), _S(16, 128, mma=True),
                        _S(16, 256, loop_c=True, mma=True)),
    # `mma`: the channel sum x2 @ go^T on the tensor cores; 16 x 128: 4 SHFL / 4 LDS against the
    # default's 80 / 32, no spills (8 x 256 spills, left out). 8 x 512 is out: on the H200 (11-30) it
    # computed wrong gradients (relative error 0.56; the CPU interpreter is right) and was no faster.
    "h_aggregate_bwd": (_S(8, 256), _S(4, 256), _S(16, 256), _S(16, 128, mma=True), _S(8, 128, mma=True)),
    "h_post_bda_fwd": (_S(4, 256, True), _S(2, 256, True), _S(4, 128, True), _S(2, 512, True), _S(4, 256),
                       _S(4, 256, 2), _S(8, 256, 2), _S(8, 128, 2), _S(4, 256, 2, True), _S(8, 256, 2, True),
                       _S(4, 256, True, True), _S(4, 256, mma=True), _S(4, 256, loop_c=True, mma=True),
                       _S(8, 128, mma=True), _S(8, 256, loop_c=True, mma=True)),
    # Out after the H200 sweep of 11-30, slower than the default (0.90 ms): 16 x 64 (1.34), 32 x 64 per
    # stream (1.07), 4 x 128 `mma` (3.91).
    "h_post_bda_bwd": (_S(32, 64), _S(64, 32), _S(16, 64, True),
                       _S(16, 128, True), _S(8, 128, True), _S(8, 64, 2), _S(4, 64, 2), _S(8, 32, 2),
                       _S(4, 128, 2), _S(8, 64, mma=True), _S(8, 128, mma=True), _S(16, 64, mma=True),
                       _S(16, 128, mma=True)),
    "mapping_fwd": (tiling.MappingTiles(64, 128), tiling.MappingTiles(128, 64), tiling.MappingTiles(128, 128),
                    tiling.MappingTiles(64, 256)),
    # The dx/dW loop spills at the 32 x 128 default (sm_90: 536 B of stack, 193 STL, 152 LDL per
    # block's code; `resources`); 16 x 64 compiles without spills in bf16 and fp32, 64 x 64, 16 x 256
    # and 32 x 32 in bf16. 64 x 128 (1.70 ms) and larger tiles (3-5 ms) lost on the H200 on 11-29.
    "mapping_bwd": (tiling.MappingTiles(32, 128), tiling.MappingTiles(16, 64), tiling.MappingTiles(64, 64),
                    tiling.MappingTiles(16, 256), tiling.MappingTiles(32, 32), tiling.MappingTiles(32, 64),
                    tiling.MappingTiles(16, 128), tiling.MappingTiles(16, 64, True), tiling.MappingTiles(32, 64, True),
                    tiling.MappingTiles(32, 128, True)),
}


def _hinted(key: str, occupancies: tuple[int, ...], tiles=None) -> tuple[dict, ...]:
    """Override dicts: `key`'s kernels with each occupancy hint, with `tiles` (default: the heuristic's)."""
    base = {} if tiles is None else {key: tiles}
    return tuple({**base, "occupancy": {k: occ for k in tiling.KERNELS_OF[key]}} for occ in occupancies)


for _key in ("h_aggregate_fwd", "h_aggregate_bwd", "h_post_bda_fwd", "h_post_bda_bwd", "mapping_fwd", "mapping_bwd",
             "sinkhorn"):
    # The same op with its default tiles and the occupancy hint on its kernels (2, 4, 8 CTAs per SM).
    CANDIDATES[f"{_key}_occupancy"] = _hinted(_key, (2, 4, 8))
# The tuple-of-streams h_post_bda backward compiles to 255 registers x 256 threads (1 CTA per SM) unhinted,
# 128 at occupancy 2 and 64 at 4, without spills (`resources --occupancy`).
CANDIDATES["h_post_bda_bwd_occupancy"] += _hinted("h_post_bda_bwd", (2, 4), _S(8, 64, 2)) + _hinted(
    "h_post_bda_bwd", (4,), _S(16, 64, 2))
# So does the tensor-core (`mma`) h_post_bda backward: 255 x 256 unhinted, 128 / 64 registers at occupancy 2 / 4,
# no spills; shared-memory traffic LDS 321 -> 20, STS 190 -> 50, BAR 109 -> 10 against the default (sm_90).
CANDIDATES["h_post_bda_bwd_occupancy"] += _hinted("h_post_bda_bwd", (2, 4), _S(8, 64, mma=True)) + _hinted(
    "h_post_bda_bwd", (2, 4), _S(8, 128, mma=True))
# On the H200 (11-30) the tuple-of-streams 8 x 64 backward at occupancy 2 won (0.373 ms, ~61 % of copy; unhinted
# 0.520, at 4 0.551). Next to it: hint 3, and at hint 2 the 4 x 128 and 4 x 64 tuples (0.607 / 0.848 unhinted) and
# the per-stream 8 x 128 (0.511, the best unhinted tile).
CANDIDATES["h_post_bda_bwd_occupancy"] += (
    _hinted("h_post_bda_bwd", (3,), _S(8, 64, 2)) + _hinted("h_post_bda_bwd", (2,), _S(4, 128, 2))
    + _hinted("h_post_bda_bwd", (2,), _S(4, 64, 2)) + _hinted("h_post_bda_bwd", (2,), _S(8, 128, True)))
# The h_post_bda forward's winner, the C-looping tuple-of-streams 4 x 256 (0.155 ms, 84-85 % of copy), with hints;
# its 8 x 128 and 2 x 256 neighbours (8 x 128 beat 4 x 256 without the C loop: 0.231 against 0.272 ms).
CANDIDATES["h_post_bda_fwd"] += (_S(8, 128, 2, True), _S(2, 256, 2, True))
CANDIDATES["h_post_bda_fwd_occupancy"] += _hinted("h_post_bda_fwd", (2, 4), _S(4, 256, 2, True))
# And the `mma` forwards (C-looping): 255 x 256 unhinted, 128 / 64 registers at 2 / 4, no spills.
CANDIDATES["h_aggregate_fwd_occupancy"] += _hinted("h_aggregate_fwd", (2, 4), _S(8, 256, loop_c=True, mma=True))
CANDIDATES["h_post_bda_fwd_occupancy"] += _hinted("h_post_bda_fwd", (2, 4), _S(4, 256, loop_c=True, mma=True))
CANDIDATES["h_aggregate_bwd_occupancy"] += _hinted("h_aggregate_bwd", (4,), _S(16, 128, mma=True)) + _hinted(
    "h_aggregate_bwd", (2, 4), _S(8, 128, mma=True))
# The split-dx mapping backward's grad_x kernel also compiles to 255 registers x 256 threads unhinted.
CANDIDATES["mapping_bwd_occupancy"] += _hinted("mapping_bwd", (2, 4), tiling.MappingTiles(32, 128, True))
# DRAM-latency hints (`StreamTiles.latency`) on the two h_post_bda kernels still short of their H200 targets. The
# backward winner's TMA pipeline deepens with the hint (sm_90 at the sweep's shape, occupancy 2: 36 KB of shared memory
# unhinted, 46 KB at 6, 64 at 9, 74 at 10, still 2 CTAs per SM); the forward winner (plain loads) prefetches further
# into registers (LDG 32 -> 38 -> 56, registers 127 -> 158 -> 200 at 0 / 6 / 10: 4 -> 3 -> 2 CTAs per SM). The
# tensor-core backward 8 x 128: 56 -> 82 KB at 10 (`resources --sweep --keys h_post_bda_fwd,h_post_bda_bwd_occupancy`).
CANDIDATES["h_post_bda_bwd_occupancy"] += tuple(
    c for lat in (6, 9, 10) for c in _hinted("h_post_bda_bwd", (2,), _S(8, 64, 2, latency=lat))) + _hinted(
    "h_post_bda_bwd", (2,), _S(8, 128, mma=True, latency=10))
CANDIDATES["h_post_bda_fwd"] += (_S(4, 256, 2, True, latency=6), _S(4, 256, 2, True, latency=10))
# The same backwards without TMA (`StreamTiles.tma` False): plain global loads prefetched into registers, as
# the forward winner (84-85 % of copy) loads unasked, where the TMA backward reaches ~61 %. sm_90, occupancy 2: the
# tuple 8 x 64 has 14 LDG and one TMA load, the bias's (TMA: 5 LDG + 10 TMA loads), 27 KB of shared memory instead
# of 36; with latency 6 / 9, 23 / 41 LDG, no spills.
CANDIDATES["h_post_bda_bwd_occupancy"] += tuple(
    c for lat in (0, 6, 9) for c in _hinted("h_post_bda_bwd", (2,), _S(8, 64, 2, latency=lat, tma=False))) + _hinted(
    "h_post_bda_bwd", (2,), _S(8, 128, mma=True, tma=False))
# Unchecked loads and stores (`StreamTiles.unchecked`: `check_bounds=False` where the launch divides into whole tiles,
# as the sweep's T 8192 and C 4096 do) on the kernels that load without TMA, whose bounds arithmetic goes (sm_90, the
# sweep's shape, SASS instructions checked -> unchecked): the tuple 8 x 64 backward without TMA at occupancy 2 1496 ->
# 1296, with latency 6 2192 -> 1704, the tensor-core 8 x 128 without TMA 3296 -> 2904; the forward winner 4 x 256
# 1376 -> 1072 (127 -> 128 registers; at hint 4 1096 in 95), its 8 x 128 neighbour 1216 -> 928; the h_aggregate
# backward 8 x 256 without TMA 1776 instructions, 168 registers x 384 threads (TMA: 2048, 255 x 256). TMA copies
# compile to the same code either way (the copy engine checks the bounds; h_post_bda backward 8 x 64 1608, the
# h_aggregate forward winner 736, backward 2048): not candidates.
CANDIDATES["h_post_bda_bwd_occupancy"] += tuple(
    c for tl in (_S(8, 64, 2, tma=False, unchecked=True), _S(8, 64, 2, latency=6, tma=False, unchecked=True),
                 _S(8, 128, mma=True, tma=False, unchecked=True))
    for c in _hinted("h_post_bda_bwd", (2,), tl))
CANDIDATES["h_post_bda_fwd"] += (_S(4, 256, 2, True, unchecked=True), _S(8, 128, 2, True, unchecked=True))
CANDIDATES["h_post_bda_fwd_occupancy"] += _hinted("h_post_bda_fwd", (4,), _S(4, 256, 2, True, unchecked=True))
CANDIDATES["h_aggregate_bwd"] += (_S(8, 256, tma=False, unchecked=True),)
# Most expected gain first, so that a sweep its timeout cuts short has timed these: the kernels furthest
# from their targets (h_post_bda and mapping backward at ~25 % and ~11 % of copy, Sinkhorn at 2-16x its
# 10 us) before the forwards.
KEY_ORDER = ("h_post_bda_bwd", "mapping_bwd", "sinkhorn", "h_post_bda_fwd", "h_aggregate_fwd",
             "h_post_bda_bwd_occupancy", "mapping_bwd_occupancy", "h_post_bda_fwd_occupancy", "h_aggregate_fwd_occupancy",
             "mapping_fwd", "mapping_fwd_occupancy", "sinkhorn_occupancy", "h_aggregate_bwd", "h_aggregate_bwd_occupancy")
CANDIDATES = {key: CANDIDATES[key] for key in KEY_ORDER}
"""Candidates per `tiling` key (in `KEY_ORDER`): a tile object for that key, or a whole
`tiling.overridden` dict (the `*_occupancy` keys: hints, with the heuristic's or given tiles). The
first candidate of each tile key is the heuristic's choice at n = 4, C >= 256; the second run on
an H200 is in `tiling`'s docstring."""


def tile_key(key: str) -> str:
    """The `tiling` key a sweep key drives (`h_aggregate_fwd_occupancy` -> `h_aggregate_fwd`)."""
    return key.removesuffix("_occupancy")


def directions(key: str) -> tuple[str, ...]:
    """The directions (`fwd`, `bwd`) a sweep key's candidates are timed in."""
    return tiling.directions(tile_key(key))


def op_of(key: str) -> str:
    """The mHC op a sweep key times (`mapping_bwd_occupancy` -> `mapping`)."""
    return tile_key(key).removesuffix("_fwd").removesuffix("_bwd")
