"""Formulations the cuTile kernels no longer have, declared once, by name.

The product kernels (`mhc_core/kernels/cutile/`) keep what the heuristics or a shipped tuning select.
Every other formulation the tile sweep tried, or was set to try, is listed here with the tile key
it served, the tile fields that selected it, what it did, how it fared, and its `commit`, the last
commit whose kernels, wrappers, sweep candidates and parity tests still have it (`HOLDING_COMMIT` for
those retired together). To time one again, sweep it from that commit in a scratch tree, on a GPU:

    git worktree add ../mhc-lab <commit> && cd ../mhc-lab
    python -m tools.cutile.sweep --keys h_post_bda_bwd_occupancy --out sweep.json

A formulation that wins comes back into the product kernels with its parity test and leaves this
list. `RETIRED_FIELDS` says which value of each retired tile field the product's tiles imply, so
that `adopt` reads sweep files written before the retirement (`canonical_tiles`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from mhc_core.kernels.cutile import tiling

__all__ = [
    "HOLDING_COMMIT",
    "Verdict",
    "Retired",
    "RETIRED",
    "SameAs",
    "RETIRED_FIELDS",
    "implied_value",
    "by_name",
]

HOLDING_COMMIT = "a49a7c5"
"""The last commit whose cuTile kernels have every formulation retired with the cut to the selected ones."""


class Verdict(enum.Enum):
    """How a retired formulation fared."""

    LOST = "lost"
    """Timed on a GPU (the H200 sweep of 2026-11-30, T 8192, C 4096, n 4, bf16) and slower than what the
    product kept."""
    UNTIMED = "untimed"
    """Compiled offline and right on the CPU interpreter, never timed (or never timed right) on a GPU."""


@dataclass(frozen=True, kw_only=True)
class Retired:
    """One formulation: `name`, the tile `key` it served, the tile `fields` that selected it (the
    names the tile types had at `commit`), `what` it did, its `verdict`, the numbers, and `commit`,
    the last commit whose kernels have it."""

    name: str
    key: str
    fields: Mapping[str, object]
    what: str
    verdict: Verdict
    measured: str
    commit: str = HOLDING_COMMIT


@dataclass(frozen=True)
class SameAs:
    """A retired field whose implied value is that of another field of the same tile."""

    field: str


RETIRED_FIELDS: dict[str, dict[str, object]] = {
    "SinkhornTiles": {
        "batch_last": False,
        "recompute": SameAs("per_element"),
        "approx_div": SameAs("per_element"),
        "checkpoint": 0,
        "fwd_checkpoints": False,
    },
    "StreamTiles": {"latency": 0, "tma": True, "unchecked": False},
    "MappingTiles": {"split_dx": False},
}
"""Per tile type, the fields it no longer has and the value its tiles imply for each (`SameAs`: the
value of the named field): a sweep row that held a retired field at that value names a tile of
this version; at any other value, a retired formulation."""

_H = "the H200 sweep (11-30)"

RETIRED: tuple[Retired, ...] = (
    Retired(
        name="sinkhorn-batch-last",
        key="sinkhorn",
        fields={"batch_last": True},
        what="the block's matrices as [n, n, TILE_B] (a permuted view), matrix axes inside a thread",
        verdict=Verdict.LOST,
        measured=f"{_H}: best 32: 0.0080 + 0.0448 ms (fwd + bwd) against the shipped "
        "per-element 0.0067 + 0.0275",
    ),
    Retired(
        name="sinkhorn-recompute",
        key="sinkhorn",
        fields={"recompute": True, "per_element": False},
        what="[TILE_B, n, n] backward replaying each pair's input from the start instead of a stored trajectory",
        verdict=Verdict.LOST,
        measured="first H200 run: 0.25 ms backward against 0.16 stored (B 8192); "
        f"{_H}, batch-last: 0.0132 + 0.146 / 0.0238 + 0.2627 ms",
    ),
    Retired(
        name="sinkhorn-per-element-ieee",
        key="sinkhorn",
        fields={"per_element": True, "approx_div": False},
        what="per-element kernels with IEEE fp32 divisions",
        verdict=Verdict.LOST,
        measured=f"{_H}: 128 stored 0.0247 + 0.0593 ms, recomputing 0.0247 + 0.2232, against div.approx "
        "0.0067 + 0.0275",
    ),
    Retired(
        name="sinkhorn-per-element-stored",
        key="sinkhorn",
        fields={"per_element": True, "recompute": False, "approx_div": True},
        what="per-element backward walking an element-major stored trajectory [P, n*n, B]",
        verdict=Verdict.UNTIMED,
        measured=f"{_H}: 64 timed 0.0072 + 0.0148 ms (the fastest Sinkhorn) in a form "
        "that computed wrong gradients for megatron_main / megatron_dev (a one-step-ahead load); the form at "
        "its commit loads each pair's input where it is used and has had no GPU parity run",
    ),
    Retired(
        name="sinkhorn-checkpoint",
        key="sinkhorn",
        fields={"per_element": True, "checkpoint": 4},
        what="per-element backward storing every k-th pair input and replaying each segment in registers "
        "(pair count compiled in, at most 32 pairs)",
        verdict=Verdict.UNTIMED,
        measured="sm_90 at the sweep's shape: 64 x every 4th 255 registers, a 24 B stack; 2 CTAs per SM",
    ),
    Retired(
        name="sinkhorn-fwd-checkpoints",
        key="sinkhorn",
        fields={"per_element": True, "checkpoint": 4, "fwd_checkpoints": True},
        what="the forward stores the checkpoints and autograd keeps them, so the backward skips its forward walk",
        verdict=Verdict.UNTIMED,
        measured="sm_90: 208 / 184 registers at every 4th / 2nd, no spills",
    ),
    Retired(
        name="stream-whole-forward",
        key="h_post_bda_fwd",
        fields={"per_stream": 0, "mma": False},
        what="the stream forwards on whole [TILE_T, n, TILE_C] tiles, summed over the middle axis",
        verdict=Verdict.LOST,
        measured=f"{_H}: h_post_bda 4 x 256 0.4605 ms against 0.3563 per stream; "
        "h_aggregate 2 x 512 0.8322 against 0.1442",
    ),
    Retired(
        name="post-bda-bwd-slices",
        key="h_post_bda_bwd",
        fields={"per_stream": 1},
        what="h_post_bda backward from per-stream slices of whole-tile loads",
        verdict=Verdict.LOST,
        measured=f"{_H}: best 8 x 128 0.5111 ms against the tuple 8 x 64 at occupancy 2 0.3732",
    ),
    Retired(
        name="post-bda-fwd-mma",
        key="h_post_bda_fwd",
        fields={"mma": True},
        what="h_post_bda forward with the residual mix on the tensor cores (whole tile x block-diagonal M^T)",
        verdict=Verdict.LOST,
        measured=f"{_H}: 4 x 256 C-looping at occupancy 4 0.1559 ms against the tuple 0.1549",
    ),
    Retired(
        name="post-bda-bwd-mma",
        key="h_post_bda_bwd",
        fields={"mma": True},
        what="h_post_bda backward with its n*n + n channel sums as tensor-core products (diagonal blocks kept)",
        verdict=Verdict.LOST,
        measured=f"{_H}: 8 x 128 at occupancy 2 0.4769 ms against 0.3732; the latency-"
        "hinted and TMA-less 8 x 128 never timed",
    ),
    Retired(
        name="aggregate-bwd-mma",
        key="h_aggregate_bwd",
        fields={"mma": True},
        what="h_aggregate backward with the channel sum x2 @ go^T on the tensor cores",
        verdict=Verdict.LOST,
        measured=f"{_H}: 16 x 128 0.1554 ms against the default 8 x 256 0.1525",
    ),
    Retired(
        name="mapping-split-dx",
        key="mapping_bwd",
        fields={"split_dx": True},
        what="mapping backward with grad_x from its own grid-parallel kernel (x read twice)",
        verdict=Verdict.LOST,
        measured=f"{_H}: 32 x 128 at occupancy 2 0.5712 ms against 16 x 256 0.3821",
    ),
    Retired(
        name="stream-latency-hint",
        key="h_post_bda_bwd",
        fields={"latency": 9},
        what="cuTile's DRAM-latency hint (1-10) on the stream kernels' streaming loads: deeper load pipelines",
        verdict=Verdict.UNTIMED,
        measured="sm_90, the tuple 8 x 64 backward at occupancy 2: 36 KB of shared "
        "memory unhinted, 46 / 64 / 74 KB at 6 / 9 / 10",
    ),
    Retired(
        name="stream-no-tma",
        key="h_post_bda_bwd",
        fields={"tma": False},
        what="the streaming loads without TMA (allow_tma=False): plain loads prefetched into registers, as the "
        "h_post_bda forward winner (84-85 % of copy) loads unasked",
        verdict=Verdict.UNTIMED,
        measured="sm_90, the tuple 8 x 64 backward: 14 LDG + 1 TMA load instead of 5 + 10, 27 KB of shared "
        "memory instead of 36",
    ),
    Retired(
        name="stream-unchecked",
        key="h_post_bda_fwd",
        fields={"unchecked": True},
        what="unchecked streaming loads and stores (check_bounds=False, tileiras >= 13.4) in launches of whole "
        "tiles",
        verdict=Verdict.UNTIMED,
        measured="sm_90, SASS instructions: the h_post_bda forward winner "
        "1376 -> 1072, the TMA-less tuple backward 1496 -> 1296",
    ),
)
"""Every retired formulation, by name."""


def by_name(name: str) -> Retired:
    """The entry named `name`; `KeyError` listing the names."""
    for r in RETIRED:
        if r.name == name:
            return r
    raise KeyError(f"no retired formulation {name!r}; have: {', '.join(r.name for r in RETIRED)}")


def implied_value(type_name: str, field: str, fields: Mapping[str, object]) -> object:
    """The value this version's tiles of `type_name` imply for retired `field`, given a tile's other
    `fields` (`KeyError` for a field that is not retired)."""
    value = RETIRED_FIELDS[type_name][field]
    if isinstance(value, SameAs):
        default = next(
            f.default for f in dataclasses.fields(tiling.TILE_TYPES[type_name]) if f.name == value.field
        )
        return fields.get(value.field, default)
    return value
