"""Tile sizes of the cuTile kernels: one small, documented heuristic per kernel family.

cuTile tile dimensions are compile-time constants and must be powers of two. The heuristics
below depend only on `n` and on `C` / `K` through a cap, so every hidden size from 256 up
(all real models) gets the same constants, the JIT compiles each kernel once per
(n, dtypes, variant), and `tools/cutile/signatures.py` can list the whole set for CI.

| kernel | constants | rule |
|---|---|---|
| sinkhorn fwd / bwd | `TILE_B` matrices per block | `1024 // (n*n)` capped at 64: n=2,4 -> 64, n=8 -> 16 (about 1k fp32 values per live tile) |
| h_aggregate fwd | `TILE_T x n x TILE_C`, `SLICES` | `TILE_C = min(256, pow2(C))`, `TILE_T = 8192 // (n * TILE_C)` clamped to [1, 32] |
| h_aggregate bwd | same, `WHOLE` | one block per token tile walks all of C (grad_h needs no second pass) |
| h_post_bda fwd | `TILE_C = min(256, pow2(C))`, `TILE_T = 4096 // (n * TILE_C)`, `SLICES` | |
| h_post_bda bwd | `TILE_C = min(64, pow2(C))`, `TILE_T = 8192 // (n * TILE_C)`, `WHOLE` | many tokens, few channels: the fp32 bias partials are `T/TILE_T x C` |
| mapping fwd | `TILE_M = 64`, `TILE_K = 128` | K splits are a runtime value (`split_count`) |
| mapping bwd | `TILE_M = 32`, `TILE_K = 128` | token splits are a runtime value |

Split counts (mapping only) are runtime arguments, not constants: enough blocks to cover about
two waves of the GPU's SMs, while each split keeps at least four K (or token) tiles.

`overridden(...)` replaces any of these choices inside a `with` block (the tile sweep,
`tools.cutile.sweep`, uses it to time candidates through the real wrappers).

The heuristics at n = 4, C >= 256 were the fastest candidates of the tile sweep on an H200 at
T = 8192, C = 4096, bf16, before a tuning file existed (`docs/cutile.md`, "Tiling").
A tuning (`mhc_core.kernels.cutile.tuning`: a sweep's winners on one GPU model, as JSON) sits
between the two: `set_tuning(t)` / `tuned(t)` make its tiles the defaults for its `n` (a stream
tile only where `TILE_C <= pow2(C)`), and its occupancy hints the defaults of their kernels. The
order of precedence is `overridden` > the tuning > the heuristics below.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "SUPPORTED_N",
    "next_pow2",
    "SinkhornTiles",
    "sinkhorn_tile",
    "StreamLayout",
    "StreamTiles",
    "STREAM_FORMULATIONS",
    "tile_fields",
    "aggregate_tiles",
    "post_bda_tiles",
    "MappingTiles",
    "PreTiles",
    "pre_tiles",
    "TILE_TYPES",
    "mapping_tiles",
    "split_count",
    "TILE_KEYS",
    "KERNELS_OF",
    "override",
    "overridden",
    "occupancy",
    "DEFAULT_OCCUPANCY",
    "check_tile",
    "directions",
    "set_tuning",
    "tuned",
    "active_tuning",
]

SUPPORTED_N = (2, 4, 8)
"""Residual-stream counts with kernels: powers of two (tile shapes must be powers of two)."""

TILE_KEYS = (
    "sinkhorn",
    "h_aggregate_fwd",
    "h_aggregate_bwd",
    "h_post_bda_fwd",
    "h_post_bda_bwd",
    "mapping_fwd",
    "mapping_bwd",
    "pre",
    "occupancy",
)
"""What `overridden` can replace: `sinkhorn` takes a `SinkhornTiles`, `mapping_*` a `MappingTiles`,
`pre` a `PreTiles`, the others a `StreamTiles`; `occupancy` a `{kernel name: CTAs per SM}` dict, the cuTile compiler
hint (`ct.kernel(occupancy=...)`, 1-32; unset: the compiler's choice), which the GPU runtime
applies at launch."""

KERNELS_OF = {
    "sinkhorn": (
        "sinkhorn_fwd_kernel",
        "sinkhorn_bwd_kernel",
        "sinkhorn_fwd_elem_kernel",
        "sinkhorn_bwd_elem_kernel",
    ),
    "h_aggregate_fwd": ("h_aggregate_fwd_kernel",),
    "h_aggregate_bwd": ("h_aggregate_bwd_kernel",),
    "h_post_bda_fwd": ("h_post_bda_fwd_kernel",),
    "h_post_bda_bwd": ("h_post_bda_bwd_kernel",),
    "mapping_fwd": ("mapping_fwd_partial_kernel", "mapping_fwd_epilogue_kernel"),
    "mapping_bwd": ("mapping_bwd_coef_kernel", "mapping_bwd_dx_dw_kernel"),
    "pre": ("h_aggregate_bwd_h_kernel", "pre_bwd_dx_dw_kernel"),
}
"""The kernels each tile key drives."""

_OVERRIDES: dict[str, Any] = {}


def _is_pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def _is_int_in(v: object, low: int, high: float = float("inf")) -> bool:
    """`v` is an integer (not a bool) in `[low, high]`."""
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def check_tile(key: str, value: object, where: str = "tiling.overridden") -> None:
    """Raise `ValueError` (prefixed by `where`) unless `value` is a legal choice for tile key `key`:
    the key's tile type with power-of-two sizes, or for `occupancy` a `{kernel name: 1-32}` dict."""
    if key not in TILE_KEYS:
        raise ValueError(f"{where}: unknown key {key!r}; valid: {', '.join(TILE_KEYS)}")
    if key == "occupancy":
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: occupancy={value!r}: expected a {{kernel name: CTAs per SM}} mapping")
        known = {k for names in KERNELS_OF.values() for k in names}
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise ValueError(
                f"{where}: occupancy names unknown kernels {unknown}; valid: {', '.join(sorted(known))}"
            )
        bad = {k: v for k, v in value.items() if not _is_int_in(v, 1, 32)}
        if bad:
            raise ValueError(f"{where}: occupancy={bad!r}: CTAs per SM must be an integer in 1-32")
        return
    kind = (
        SinkhornTiles
        if key == "sinkhorn"
        else MappingTiles
        if key.startswith("mapping")
        else PreTiles
        if key == "pre"
        else StreamTiles
    )
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key}={value!r}: expected a {kind.__name__}")
    if isinstance(value, PreTiles):
        if not isinstance(value.fused, bool):
            raise ValueError(f"{where}: {key}={value!r}: fused must be a bool")
        return
    dims = (
        (value.tile_b,)
        if isinstance(value, SinkhornTiles)
        else (value.tile_m, value.tile_k)
        if isinstance(value, MappingTiles)
        else (value.tile_t, value.tile_c)
    )
    if not all(_is_pow2(d) for d in dims):
        raise ValueError(f"{where}: {key}={value!r}: tile sizes must be powers of two")
    if isinstance(value, StreamTiles):
        if (
            not isinstance(value.per_stream, StreamLayout)
            or not isinstance(value.loop_c, bool)
            or not isinstance(value.mma, bool)
        ):
            raise ValueError(
                f"{where}: {key}={value!r}: per_stream must be a StreamLayout (or 0-2), loop_c and mma bools"
            )
        form = (value.per_stream, value.mma)
        if form not in STREAM_FORMULATIONS[key]:
            have = ", ".join(
                f"per_stream={p.name}" + (", mma=True" if m else "") for p, m in STREAM_FORMULATIONS[key]
            )
            raise ValueError(
                f"{where}: {key}={value!r}: no {key} kernel for per_stream={value.per_stream.name}"
                f"{', mma=True' if value.mma else ''}; the kernels have: {have}"
            )
        if value.loop_c and not key.endswith("_fwd"):
            raise ValueError(
                f"{where}: {key}={value!r}: loop_c applies to the forwards (the backwards always loop)"
            )
    if isinstance(value, SinkhornTiles) and not isinstance(value.per_element, bool):
        raise ValueError(f"{where}: {key}={value!r}: per_element must be a bool")


def override(key: str, cand) -> dict:
    """The `overridden` keywords of one candidate tile (or override dict) of key `key`."""
    return cand if isinstance(cand, dict) else {key: cand}


@contextmanager
def overridden(**tiles: object) -> Iterator[None]:
    """Use the given tiles (keys from `TILE_KEYS`) instead of the tuning and the heuristics inside the block."""
    for key, value in tiles.items():
        check_tile(key, value)
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(tiles)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


_TUNING: Any = None  # the process-wide tuning (a `tuning.Tuning`) or None


def set_tuning(tuning: Any) -> None:
    """Make `tuning` (a `mhc_core.kernels.cutile.tuning.Tuning`, or None for the heuristics alone)
    the process-wide defaults. The GPU runtime sets the one `tuning.resolve` finds on its first launch."""
    global _TUNING
    _TUNING = tuning


def active_tuning() -> Any:
    """The tuning in force (None: heuristics only)."""
    return _TUNING


@contextmanager
def tuned(tuning: Any) -> Iterator[None]:
    """`set_tuning(tuning)` inside the block only (the sweep times against the heuristics under `tuned(None)`)."""
    global _TUNING
    saved, _TUNING = _TUNING, tuning
    try:
        yield
    finally:
        _TUNING = saved


def directions(key: str) -> tuple[str, ...]:
    """The op directions tile key `key` drives: `*_fwd` the forward, `*_bwd` the backward,
    `sinkhorn` (one tile for both) both."""
    return ("fwd",) if key.endswith("_fwd") else ("bwd",) if key.endswith("_bwd") else ("fwd", "bwd")


def _chosen(key: str, n: int, c: int | None = None) -> Any:
    """The tile `overridden` sets for `key`, else the tuning's at `n` (and channel count `c` for
    stream tiles: only where its `TILE_C <= pow2(C)`), else None: the heuristic decides."""
    if key in _OVERRIDES:
        return _OVERRIDES[key]
    t = _TUNING
    if t is None or t.n != n or key not in t.tiles:
        return None
    tile = t.tiles[key]
    if c is not None and tile.tile_c > next_pow2(c):
        return None
    return tile


DEFAULT_OCCUPANCY: dict[str, int] = {}
"""Occupancy hints the defaults carry (`{kernel name: CTAs per SM}`; none yet: an entry lands when
a GPU sweep shows it wins). The GPU runtime and CI's offline compile (`runtime.kernel_object`)
both apply them."""


def occupancy(kernel_name: str) -> int | None:
    """The occupancy hint for `kernel_name`: inside `overridden(occupancy=...)` the override's (a
    kernel the override does not name keeps no hint), else the tuning's (at every `n`: a hint is a
    property of the kernel object), else `DEFAULT_OCCUPANCY`'s, else None."""
    if "occupancy" in _OVERRIDES:
        return _OVERRIDES["occupancy"].get(kernel_name)
    t = _TUNING
    if t is not None and kernel_name in t.occupancy:
        return t.occupancy[kernel_name]
    return DEFAULT_OCCUPANCY.get(kernel_name)


def tile_fields(tile: Any) -> dict[str, Any]:
    """A tile's fields as a dict of JSON values (a `StreamLayout` as its number)."""
    return {
        f.name: int(v) if isinstance(v := getattr(tile, f.name), StreamLayout) else v for f in fields(tile)
    }


def next_pow2(v: int) -> int:
    """Smallest power of two >= max(v, 1)."""
    return 1 << max(int(v) - 1, 0).bit_length()


@dataclass(frozen=True)
class SinkhornTiles:
    """Tile of the Sinkhorn kernels: `tile_b` matrices per block, `[TILE_B, n, n]` with a stored
    trajectory for the backward (`sinkhorn_kernels`); `per_element`: the kernels of
    `sinkhorn_kernels`' `*_elem_kernel` pair instead (one `[TILE_B]` tile per matrix element, `div.approx`
    divisions, a backward that recomputes each pair's input)."""

    tile_b: int
    per_element: bool = False


def sinkhorn_tile(n: int) -> SinkhornTiles:
    """The Sinkhorn kernels' tile."""
    chosen = _chosen("sinkhorn", n)
    return chosen if chosen is not None else SinkhornTiles(tile_b=max(1, min(64, 1024 // (n * n))))


class StreamLayout(enum.IntEnum):
    """How a stream kernel holds its tiles (`StreamTiles.per_stream`; numbered as in tuning files)."""

    WHOLE = 0
    """Whole `[TILE_T, n, TILE_C]` tiles, reduced over or broadcast along the middle axis."""
    SLICES = 1
    """One `[TILE_T, n, TILE_C]` load, worked on (and stored) as one `[TILE_T, TILE_C]` slice per stream."""
    TUPLE = 2
    """Each stream loaded alone, into a tuple of `[TILE_T, TILE_C]` tiles (no middle axis at all); the
    h_post_bda backward then carries its `n*n + n` channel sums as elementwise partials across the C loop."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


STREAM_FORMULATIONS: dict[str, frozenset[tuple[StreamLayout, bool]]] = {
    "h_aggregate_fwd": frozenset({(StreamLayout.SLICES, False), (StreamLayout.WHOLE, True)}),
    "h_aggregate_bwd": frozenset({(StreamLayout.WHOLE, False)}),
    "h_post_bda_fwd": frozenset({(StreamLayout.SLICES, False), (StreamLayout.TUPLE, False)}),
    "h_post_bda_bwd": frozenset({(StreamLayout.WHOLE, False), (StreamLayout.TUPLE, False)}),
}
"""The `(per_stream, mma)` pairs each stream kernel has (the heuristics' and the shipped tunings'
formulations; the others the sweep tried are declared in the lab, `tools/cutile/retired.py`)."""


@dataclass(frozen=True)
class StreamTiles:
    """Tile of the stream kernels: `TILE_T` tokens x `TILE_C` channels (x all n streams).

    `per_stream`: how the kernel holds its tiles (`StreamLayout`, `STREAM_FORMULATIONS` per kernel; an
    integer 0-2 is taken as its number). `loop_c` (forwards only; the backwards always do): one block
    per token tile walks all of C instead of one block per (token, channel) tile, a loop the compiler
    can pipeline. `mma` (h_aggregate forward, with `WHOLE`): the sum over streams on the tensor cores,
    the whole `[TILE_T, n, TILE_C]` tile as a `[TILE_T*n, TILE_C]` matrix multiplied by the
    block-diagonal matrix of the block's `h_pre`; only for tiles with an MMA reduction of >= 16 and
    edges of >= 8 (`streams._tensor_cores`), smaller tiles sum per stream on the CUDA cores.
    """

    tile_t: int
    tile_c: int
    per_stream: StreamLayout = StreamLayout.WHOLE
    loop_c: bool = False
    mma: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.per_stream, int)
            and not isinstance(self.per_stream, StreamLayout)
            and self.per_stream in tuple(StreamLayout)
        ):
            object.__setattr__(self, "per_stream", StreamLayout(int(self.per_stream)))


def _stream_tiles(n: int, c: int, cap_c: int, elems: int, per_stream: StreamLayout) -> StreamTiles:
    """`TILE_C = min(cap_c, pow2(C))` and about `elems` elements per `[TILE_T, n, TILE_C]` tile."""
    tile_c = min(cap_c, next_pow2(c))
    tile_t = max(1, min(32, elems // (n * tile_c)))  # powers of two throughout
    return StreamTiles(tile_t=tile_t, tile_c=tile_c, per_stream=per_stream)


def aggregate_tiles(n: int, c: int, direction: str) -> StreamTiles:
    """`h_aggregate` tiles; `direction` is `fwd` or `bwd`."""
    chosen = _chosen(f"h_aggregate_{direction}", n, c)
    if chosen is not None:
        return chosen
    return _stream_tiles(n, c, 256, 8192, StreamLayout.SLICES if direction == "fwd" else StreamLayout.WHOLE)


def post_bda_tiles(n: int, c: int, direction: str) -> StreamTiles:
    """`h_post_bda` tiles; `direction` is `fwd` or `bwd`."""
    chosen = _chosen(f"h_post_bda_{direction}", n, c)
    if chosen is not None:
        return chosen
    if direction == "fwd":
        return _stream_tiles(n, c, 256, 4096, StreamLayout.SLICES)
    return _stream_tiles(n, c, 64, 8192, StreamLayout.WHOLE)


@dataclass(frozen=True)
class MappingTiles:
    """Tiles of the mapping kernels: `TILE_M` tokens x `TILE_K` of the n*C reduction."""

    tile_m: int = 64
    tile_k: int = 128


@dataclass(frozen=True)
class PreTiles:
    """The pre-op's formulation: `fused`, one gradient of x (the aggregate's gradient of h_pre alone, then the
    mapping's dx kernel with `h_pre (x) grad_agg` in it: `mapping.pre`, where `mapping.pre_fuses` covers the
    shape); else the mapping, Sinkhorn and aggregate ops in a row, whose backward writes two gradients of x and
    sums them. The default is the composition until a sweep's `pre` key shows the fused form faster on a
    device: its first form, the aggregate in the mapping's epilogue and coefficient kernels (one CTA per token
    block looping over C), lost on the H200 (forward 0.60 ms of GPU time at T 8192, C 4096, n 4 bf16, where the
    three ops' kernels took 0.17 ms; `docs/measurements/h200-2026-12-04/`); this one is untimed."""

    fused: bool = False


def pre_tiles(n: int) -> PreTiles:
    """The pre-op's formulation at `n` streams (`overridden`, else the tuning's, else the composition)."""
    chosen = _chosen("pre", n)
    return chosen if chosen is not None else PreTiles()


TILE_TYPES = {cls.__name__: cls for cls in (SinkhornTiles, StreamTiles, MappingTiles, PreTiles)}
"""The tile types by name, as tuning files and sweep rows write them."""


def mapping_tiles(n: int, k: int, direction: str) -> MappingTiles:
    """The mapping tiles for `direction` (`fwd` or `bwd`; fixed: K = n*C is split at run time)."""
    chosen = _chosen(f"mapping_{direction}", n)
    if chosen is not None:
        return chosen
    return MappingTiles() if direction == "fwd" else MappingTiles(tile_m=32)


def split_count(blocks: int, tiles: int, num_sms: int, *, min_tiles_per_split: int = 4) -> int:
    """Splits of a `tiles`-long reduction so that `blocks * splits` covers ~2 waves of `num_sms`.

    Returns a power of two in [1, max(1, tiles // min_tiles_per_split)].
    """
    want = max(1, -(-2 * num_sms // max(blocks, 1)))
    cap = max(1, tiles // min_tiles_per_split)
    s = 1
    while s < want and s * 2 <= cap:
        s *= 2
    return s
