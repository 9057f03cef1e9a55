"""Tile sizes of the cuTile kernels: one small, documented heuristic per kernel family.

cuTile tile dimensions are compile-time constants and must be powers of two. The heuristics
below depend only on `n` and on `C` / `K` through a cap, so every hidden size from 256 up
(all real models) gets the same constants, the JIT compiles each kernel once per
(n, dtypes, variant), and `tools/cutile/signatures.py` can list the whole set for CI.

| kernel | constants | rule |
|---|---|---|
| sinkhorn fwd / bwd | `TILE_B` matrices per block | `1024 // (n*n)` capped at 64: n=2,4 -> 64, n=8 -> 16 (about 1k fp32 values per live tile) |
| h_aggregate fwd | `TILE_T x n x TILE_C`, per stream | `TILE_C = min(256, pow2(C))`, `TILE_T = 8192 // (n * TILE_C)` clamped to [1, 32] |
| h_aggregate bwd | same, whole tile | one block per token tile walks all of C (grad_h needs no second pass) |
| h_post_bda fwd | `TILE_C = min(256, pow2(C))`, `TILE_T = 4096 // (n * TILE_C)`, per stream | |
| h_post_bda bwd | `TILE_C = min(64, pow2(C))`, `TILE_T = 8192 // (n * TILE_C)` | many tokens, few channels: the fp32 bias partials are `T/TILE_T x C` |
| mapping fwd | `TILE_M = 64`, `TILE_K = 128` | K splits are a runtime value (`split_count`) |
| mapping bwd | `TILE_M = 32`, `TILE_K = 128` | token splits are a runtime value |

The constants at n = 4, C >= 256 are the fastest candidates of the tile sweep
(`tools.cutile.sweep`) on an H200 at T = 8192, C = 4096, bf16 (ms of the
pipelined op; the first column was the previous default):

| key | previous | chosen | speed-up |
|---|---|---|---|
| h_aggregate fwd | (2, 512) whole tile 0.823 | (8, 256) per stream 0.156 | 5.3x |
| h_aggregate bwd | (4, 256) 0.206 | (8, 256) 0.183 | 1.1x |
| h_post_bda fwd | (4, 256) whole tile 0.470 | (4, 256) per stream 0.366 | 1.3x |
| h_post_bda bwd | (8, 128) 1.628 | (32, 64) 0.926 | 1.8x |
| mapping bwd | (64, 128) 1.696 | (32, 128) 1.004 | 1.7x |

Split counts (mapping only) are runtime arguments, not constants: enough blocks to cover about
two waves of the GPU's SMs, while each split keeps at least four K (or token) tiles.

`overridden(...)` replaces any of these choices inside a `with` block (the tile sweep,
`tools.cutile.sweep`, uses it to time candidates through the real wrappers).

A tuning (`mhc_core.kernels.cutile.tuning`: a sweep's winners on one GPU model, as JSON) sits
between the two: `set_tuning(t)` / `tuned(t)` make its tiles the defaults for its `n` (a stream
tile only where `TILE_C <= pow2(C)`), and its occupancy hints the defaults of their kernels. The
order of precedence is `overridden` > the tuning > the heuristics below.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from mhc_core.kernels.cutile.load_codes import NO_TMA, UNCHECKED

__all__ = [
    "SUPPORTED_N",
    "next_pow2",
    "SinkhornTiles",
    "MAX_CHECKPOINT_PAIRS",
    "sinkhorn_tile",
    "StreamTiles",
    "NO_TMA",
    "UNCHECKED",
    "load_code",
    "ADDED_FIELDS",
    "tile_fields",
    "aggregate_tiles",
    "post_bda_tiles",
    "MappingTiles",
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

TILE_KEYS = ("sinkhorn", "h_aggregate_fwd", "h_aggregate_bwd", "h_post_bda_fwd", "h_post_bda_bwd",
             "mapping_fwd", "mapping_bwd", "occupancy")
"""What `overridden` can replace: `sinkhorn` takes a `SinkhornTiles`, `mapping_*` a `MappingTiles`,
the others a `StreamTiles`; `occupancy` a `{kernel name: CTAs per SM}` dict, the cuTile compiler
hint (`ct.kernel(occupancy=...)`, 1-32; unset: the compiler's choice), which the GPU runtime
applies at launch."""

KERNELS_OF = {
    "sinkhorn": ("sinkhorn_fwd_kernel", "sinkhorn_bwd_kernel", "sinkhorn_fwd_elem_kernel", "sinkhorn_bwd_elem_kernel",
                 "sinkhorn_fwd_checkpoint_kernel", "sinkhorn_bwd_checkpoint_kernel"),
    "h_aggregate_fwd": ("h_aggregate_fwd_kernel",),
    "h_aggregate_bwd": ("h_aggregate_bwd_kernel",),
    "h_post_bda_fwd": ("h_post_bda_fwd_kernel",),
    "h_post_bda_bwd": ("h_post_bda_bwd_kernel",),
    "mapping_fwd": ("mapping_fwd_partial_kernel", "mapping_fwd_epilogue_kernel"),
    "mapping_bwd": ("mapping_bwd_coef_kernel", "mapping_bwd_dx_dw_kernel", "mapping_bwd_dx_kernel"),
}
"""The kernels each tile key drives."""

_OVERRIDES: dict[str, object] = {}


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
            raise ValueError(f"{where}: occupancy names unknown kernels {unknown}; valid: {', '.join(sorted(known))}")
        bad = {k: v for k, v in value.items() if not _is_int_in(v, 1, 32)}
        if bad:
            raise ValueError(f"{where}: occupancy={bad!r}: CTAs per SM must be an integer in 1-32")
        return
    kind = SinkhornTiles if key == "sinkhorn" else MappingTiles if key.startswith("mapping") else StreamTiles
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key}={value!r}: expected a {kind.__name__}")
    dims = (value.tile_b,) if key == "sinkhorn" else (
        (value.tile_m, value.tile_k) if key.startswith("mapping") else (value.tile_t, value.tile_c))
    if not all(_is_pow2(d) for d in dims):
        raise ValueError(f"{where}: {key}={value!r}: tile sizes must be powers of two")
    if isinstance(value, StreamTiles):
        if not _is_int_in(value.latency, 0, 10):
            raise ValueError(f"{where}: {key}={value!r}: latency must be an integer in 0-10 (0: the compiler's choice)")
        if not isinstance(value.tma, bool):
            raise ValueError(f"{where}: {key}={value!r}: tma must be True (the compiler may use TMA) or False")
        if not isinstance(value.unchecked, bool):
            raise ValueError(f"{where}: {key}={value!r}: unchecked must be True (unchecked loads where the launch "
                             "divides into whole tiles) or False")
    if key == "sinkhorn":
        ck = value.checkpoint
        if not _is_int_in(ck, 0):
            raise ValueError(f"{where}: {key}={value!r}: checkpoint must be an integer >= 0 (0: off)")
        if ck and not value.per_element:
            raise ValueError(f"{where}: {key}={value!r}: checkpoint applies to the per-element kernels only")
        if value.fwd_checkpoints is not False and (value.fwd_checkpoints is not True or not ck):
            raise ValueError(f"{where}: {key}={value!r}: fwd_checkpoints is a bool and needs checkpoint >= 1")


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


ADDED_FIELDS = {"SinkhornTiles": ("checkpoint", "fwd_checkpoints"), "StreamTiles": ("latency", "tma", "unchecked")}
"""Tile fields newer than the shipped H200 sweep and tuning: `tile_fields` and the tiles' reprs
leave them out while they hold their default, so sweep files and tunings written without them
still name, and digest to, the same tiles."""


def tile_fields(tile: Any) -> dict[str, Any]:
    """A tile's fields as a dict (`dataclasses.asdict`) without its `ADDED_FIELDS` at their defaults."""
    added = ADDED_FIELDS.get(type(tile).__name__, ())
    return {f.name: getattr(tile, f.name) for f in fields(tile)
            if not (f.name in added and getattr(tile, f.name) == f.default)}


def _repr(tile: Any) -> str:
    """The dataclass repr of `tile_fields` (the sweep keys its rows by a candidate's repr)."""
    return f"{type(tile).__name__}({', '.join(f'{k}={v!r}' for k, v in tile_fields(tile).items())})"


def next_pow2(v: int) -> int:
    """Smallest power of two >= max(v, 1)."""
    return 1 << max(int(v) - 1, 0).bit_length()


@dataclass(frozen=True)
class SinkhornTiles:
    """Tile of the Sinkhorn kernels: `tile_b` matrices per block; `batch_last` holds them as
    `[n, n, TILE_B]` instead of `[TILE_B, n, n]`; `recompute`: the backward replays each pair's
    input from the start instead of storing the trajectory (see `sinkhorn_kernels`);
    `per_element`: the kernels of `sinkhorn_elem_kernels` (one `[TILE_B]` tile per matrix element,
    `batch_last` does not apply); `approx_div` (per-element only): fp32 `div.approx` divisions
    (<= 2 ulp) instead of IEEE ones; `checkpoint` (per-element only; 0: off): the backward is
    checkpointed (`sinkhorn_bwd_checkpoint_kernel`, the pair count compiled in): every
    `checkpoint`-th pair input stored, the others replayed in registers per segment, for runs of at most
    `MAX_CHECKPOINT_PAIRS` pairs (longer runs take the `recompute` / stored backward);
    `fwd_checkpoints` (with `checkpoint`): the forward stores the checkpoints
    (`sinkhorn_fwd_checkpoint_kernel`) and autograd keeps them for the backward, which then skips its
    own forward walk (pair evaluations per backward at 20 pairs, every 4th: 16 + the VJPs' instead
    of 35 +), for `cdiv(P, checkpoint) * n*n` fp32 more saved per matrix (5 x 64 B at n = 4)."""

    tile_b: int
    batch_last: bool = False
    recompute: bool = False
    per_element: bool = False
    approx_div: bool = False
    checkpoint: int = 0
    fwd_checkpoints: bool = False

    def __repr__(self) -> str:
        return _repr(self)


MAX_CHECKPOINT_PAIRS = 32
"""The most normalisation pairs the checkpointed Sinkhorn backward unrolls (`SinkhornTiles.checkpoint`):
20 iterations (the default) are 20 pairs; each pair unrolls to ~100 instructions per walk."""


def sinkhorn_tile(n: int) -> SinkhornTiles:
    """The Sinkhorn kernels' tile."""
    chosen = _chosen("sinkhorn", n)
    return chosen if chosen is not None else SinkhornTiles(tile_b=max(1, min(64, 1024 // (n * n))))


@dataclass(frozen=True)
class StreamTiles:
    """Tile of the stream kernels: `TILE_T` tokens x `TILE_C` channels (x all n streams).

    `per_stream` (h_aggregate fwd, h_post_bda fwd and bwd): work on (and store) one
    `[TILE_T, TILE_C]` slice per stream instead of whole `[TILE_T, n, TILE_C]` tiles (same bytes,
    no reduction across or broadcast along the middle axis). `2` (h_post_bda only): load the
    residual (backward: and `grad_out`) stream by stream as well, into a tuple of 2-D tiles; the
    backward carries its `n*n + n` channel sums as elementwise partials across the C loop.
    `loop_c` (forwards only; the backwards always do): one block per token tile walks all of C
    instead of one block per (token, channel) tile, a loop the compiler can pipeline.
    `mma`: the sum over streams on the tensor cores, with whole `[TILE_T, n, TILE_C]` tiles as
    `[TILE_T*n, TILE_C]` matrices: the forwards multiply them by the block-diagonal matrix of the
    block's coefficients (`h_pre`, `M^T`), the backwards take their channel sums as products of
    the grad_out and x / residual tiles (diagonal blocks kept; h_post_bda's other gradients per
    stream). Only for tiles with an MMA reduction of >= 16 and edges of >= 8 (`ops_streams._mma_code`);
    smaller tiles keep the CUDA-core formulation.
    `latency` (0: the compiler's inference; 1-10): cuTile's DRAM-latency hint on the kernel's
    streaming loads, which sets how deep the compiler pipelines them (sm_90, the tuple-of-streams
    h_post_bda backward 8 x 64 at occupancy 2, T 8192 C 4096 bf16: 36 KB of shared memory unhinted, 46 KB
    at 6, 64 KB at 9, 74 KB at 10: more loads in flight per SM).
    `tma` False: the same streaming loads without TMA (cuTile's `allow_tma=False`): plain global
    loads, prefetched into registers instead of copied into shared memory (sm_90, the same
    backward: 14 LDG and one TMA load, the bias's, instead of 5 and 10, 27 KB of shared memory instead
    of 36; with latency 9, 41 LDG). The h_post_bda forward winner loads that way unasked, at 84-85 % of copy,
    where the TMA backward stays at ~61 %. True (default) leaves the choice to the compiler.
    `unchecked`: the streaming loads and stores skip cuTile's bounds check (`check_bounds=False`, tileiras
    >= 13.4) in a launch whose T and C are whole multiples of `TILE_T` and `TILE_C` (the wrapper decides per
    launch, `load_code`; a launch with a partial tile, or a runtime whose compiler is older, keeps the checked
    accesses, so the tile is right at every shape). It changes plain loads and stores only (`tma` False, or
    what the compiler does without TMA): sm_90, the sweep's shape, the tuple 8 x 64 backward without TMA
    compiles to 1296 SASS instructions instead of 1496, the h_post_bda forward winner to 1072 instead of
    1376; TMA copies compile to the same code (the copy engine checks the bounds).
    """

    tile_t: int
    tile_c: int
    per_stream: int = 0
    loop_c: bool = False
    mma: bool = False
    latency: int = 0
    tma: bool = True
    unchecked: bool = False

    def __repr__(self) -> str:
        return _repr(self)


def load_code(tile: StreamTiles, *, tokens: int, hidden: int, unchecked_ok: bool) -> int:
    """The stream kernels' `LOADS` constant for `tile` in a launch over `tokens` x `hidden` (T x C): its
    latency hint (0-10), plus `NO_TMA` when TMA is forbidden, plus `UNCHECKED` when `tile.unchecked`, the
    launch divides into whole tiles (`tokens % TILE_T == hidden % TILE_C == 0`) and the runtime's compiler
    takes unchecked loads (`unchecked_ok`). The codes are `load_codes`'s; `stream_common.load_raw` takes
    them apart. One constant for all three keeps the kernels' signatures, and the recorded launches of
    tiles without them, as they were."""
    whole = tokens % tile.tile_t == 0 and hidden % tile.tile_c == 0
    return tile.latency + (0 if tile.tma else NO_TMA) + (UNCHECKED if tile.unchecked and whole and unchecked_ok else 0)


def _stream_tiles(n: int, c: int, cap_c: int, elems: int, per_stream: int = 0) -> StreamTiles:
    """`TILE_C = min(cap_c, pow2(C))` and about `elems` elements per `[TILE_T, n, TILE_C]` tile."""
    tile_c = min(cap_c, next_pow2(c))
    tile_t = max(1, min(32, elems // (n * tile_c)))  # powers of two throughout
    return StreamTiles(tile_t=tile_t, tile_c=tile_c, per_stream=per_stream)


def aggregate_tiles(n: int, c: int, direction: str) -> StreamTiles:
    """`h_aggregate` tiles; `direction` is `fwd` or `bwd`."""
    chosen = _chosen(f"h_aggregate_{direction}", n, c)
    if chosen is not None:
        return chosen
    return _stream_tiles(n, c, 256, 8192, per_stream=direction == "fwd")


def post_bda_tiles(n: int, c: int, direction: str) -> StreamTiles:
    """`h_post_bda` tiles; `direction` is `fwd` or `bwd`."""
    chosen = _chosen(f"h_post_bda_{direction}", n, c)
    if chosen is not None:
        return chosen
    if direction == "fwd":
        return _stream_tiles(n, c, 256, 4096, per_stream=True)
    return _stream_tiles(n, c, 64, 8192)


@dataclass(frozen=True)
class MappingTiles:
    """Tiles of the mapping kernels: `TILE_M` tokens x `TILE_K` of the n*C reduction.

    `split_dx` (backward only): `grad_x` from its own grid-parallel kernel
    (`mapping_bwd_dx_kernel`), the K-major loop then only accumulates `grad_W` (reads `x` twice)."""

    tile_m: int = 64
    tile_k: int = 128
    split_dx: bool = False


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
