"""Adopting a tile sweep: its `--out` file checked, and its checked winners as a tuning.

The lab half of the tuned tiles: `tools.cutile.sweep --adopt` calls `from_sweep` and writes the
`mhc_core.kernels.cutile.tuning.Tuning` it returns; the product half (the `Tuning` file, where it is
found, how it is put in force) stays in `mhc_core.kernels.cutile.tuning`.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from typing import Any

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.tiling import override
from mhc_core.kernels.cutile.tuning import Tuning
from tools.cutile.retired import RETIRED_FIELDS, implied_value

__all__ = ["check_sweep", "from_sweep", "rank_ms", "canonical_tiles", "names_candidate"]


class _RetiredFormulation(Exception):
    """A sweep row's tile holds a retired field at a value this version's tiles do not imply."""


def _literal(node: ast.AST) -> object:
    """The value of a tile repr's syntax tree: constants, `StreamLayout.X`, dicts, and tile calls
    with keyword fields (retired fields dropped where they hold the value the tile implies)."""
    if isinstance(node, ast.Constant):
        return node.value
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "StreamLayout"
    ):
        return tiling.StreamLayout[node.attr]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in tiling.TILE_TYPES
        and not node.args
        and all(kw.arg for kw in node.keywords)
    ):
        name = node.func.id
        fields = {kw.arg: _literal(kw.value) for kw in node.keywords}
        for f in [f for f in fields if f in RETIRED_FIELDS.get(name, {})]:
            if fields[f] != implied_value(name, f, fields):
                raise _RetiredFormulation(f"{name}.{f}={fields[f]!r}")
        return tiling.TILE_TYPES[name](
            **{f: v for f, v in fields.items() if f not in RETIRED_FIELDS.get(name, {})}
        )
    raise ValueError(f"not a tile: {ast.unparse(node)[:80]!r}")


def canonical_tiles(key: str, text: str) -> str | None:
    """A sweep row's `tiles` (`text`, the repr of its candidate for sweep key `key`) as this version
    writes that candidate; None when it names a formulation the kernels no longer have
    (`tools.cutile.retired`). Sweep files written before a retirement thus still name today's tiles.
    `ValueError` for text that is not a tile, or an override dict, at all."""
    try:
        value = _literal(ast.parse(text, mode="eval").body)
    except _RetiredFormulation:
        return None
    except (SyntaxError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{key}: tiles {text!r} is not a tile of this version: {exc}") from None
    try:
        for k, v in override(key.removesuffix("_occupancy"), value).items():
            tiling.check_tile(k, v)
    except ValueError:
        return None
    return repr(value)


def names_candidate(key: str, text: str, candidate: object) -> bool:
    """Whether a sweep row's `tiles` (`text`, for sweep key `key`) names `candidate`, in this version's
    repr or, for rows written before a retirement, once read by `canonical_tiles` (text that is no
    tile names no candidate)."""
    if text == repr(candidate):
        return True
    try:
        return canonical_tiles(key, text) == repr(candidate)
    except ValueError:
        return False


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def rank_ms(row: Mapping) -> object:
    """What a sweep row is ranked by: its GPU busy time (`device_ms`), else (older sweep files) the
    back-to-back time (`pipelined_ms`), which equals the host's time per call whenever the host is the
    slower side (their Sinkhorn rows read 42-46 us for every TILE_B)."""
    return row.get("device_ms", row.get("pipelined_ms"))


def check_sweep(data: object, source: str) -> list[dict]:
    """The rows of a sweep's `--out` file (`data`), after checking them: `ValueError` naming `source`
    and the row (a dict per row with string `key` and `tiles`; unless it records an error, a
    `direction`, a `check` if any and a finite positive `device_ms` or `pipelined_ms`)."""
    if not isinstance(data, Mapping) or "rows" not in data:
        raise ValueError(f"{source}: not a sweep --out file (a JSON object with 'rows')")
    if not isinstance(data["rows"], list):
        raise ValueError(f"{source}: rows must be a list, got {type(data['rows']).__name__}")
    for i, r in enumerate(data["rows"]):
        if (
            not isinstance(r, dict)
            or not isinstance(r.get("key"), str)
            or not isinstance(r.get("tiles"), str)
        ):
            raise ValueError(
                f"{source}: rows[{i}] is not a sweep row (an object with 'key' and 'tiles' strings)"
            )
        if "error" in r:
            continue
        where = f"{source}: rows[{i}] ({r['key']} {r['tiles']})"
        if r.get("direction") not in ("fwd", "bwd") or r.get("check", "ok") not in ("ok", "fail"):
            raise ValueError(
                f"{where}: direction={r.get('direction')!r} / check={r.get('check')!r}: "
                "expected fwd|bwd and ok|fail (or no check: a sweep file older than the checks)"
            )
        ms = rank_ms(r)
        if not _positive(ms):
            raise ValueError(
                f"{where}: its time (device_ms, else pipelined_ms) is {ms!r}, not a finite number > 0"
            )
    return data["rows"]


def from_sweep(
    data: Mapping,
    candidates: Mapping[str, tuple],
    *,
    min_gain: float = 1.03,
    source: str = "",
    sweep: str = "sweep",
) -> tuple[Tuning, list[str]]:
    """The winners of a sweep's `--out` file (`data`, read from `sweep`, which errors name): per tile
    key, the fastest candidate (over the key and its `*_occupancy` key; GPU busy time, else
    back-to-back; Sinkhorn: forward + backward) among the rows whose result matched the reference
    (`check == "ok"`), adopted when it beats the key's default (the first candidate) by `min_gain`.
    Rows are matched to candidates by `canonical_tiles`; rows of retired formulations are left out.
    Returns the tuning (its `source`: the file it will be written to) and one line per key."""
    if not (isinstance(min_gain, int | float) and math.isfinite(min_gain) and min_gain >= 1):
        raise ValueError(f"min_gain={min_gain!r} must be a finite number >= 1")
    rows = check_sweep(data, sweep)
    missing = [k for k in ("n", "device") if k not in data]
    if missing:
        raise ValueError(f"{sweep}: not a sweep --out file (missing {', '.join(missing)})")
    n, device = data["n"], data["device"]
    if not isinstance(device, str) or not device.strip():
        raise ValueError(f"{sweep}: device={device!r} must be the GPU's name")
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{sweep}: n={n!r} must be an integer")
    times: dict[str, dict[tuple[str, str], dict[str, float]]] = {}
    for i, r in enumerate(rows):
        if "error" in r or r.get("check") != "ok":
            continue
        try:
            row_tiles = canonical_tiles(r["key"], r["tiles"])
        except ValueError as exc:
            raise ValueError(f"{sweep}: rows[{i}]: {exc}") from None
        if row_tiles is None:  # a retired formulation
            continue
        tile_key = r["key"].removesuffix("_occupancy")
        times.setdefault(tile_key, {}).setdefault((r["key"], row_tiles), {})[r["direction"]] = rank_ms(r)
    tiles: dict[str, Any] = {}
    occupancy: dict[str, int] = {}
    gains: dict[str, Any] = {}
    lines = []
    for tile_key in tiling.KERNELS_OF:
        dirs = tiling.directions(tile_key)
        totals = {
            cid: sum(t[d] for d in dirs)
            for cid, t in times.get(tile_key, {}).items()
            if all(d in t for d in dirs)
        }
        default = (tile_key, repr(candidates[tile_key][0])) if tile_key in candidates else None
        if default not in totals:
            lines.append(f"{tile_key}: default not timed or failed its check: kept the heuristic")
            continue
        best = min(totals, key=totals.get)
        gain = totals[default] / totals[best]
        if best == default or gain < min_gain:
            lines.append(f"{tile_key}: kept the default ({totals[default]:.4f} ms; best other {gain:.2f}x)")
            continue
        by_repr = {repr(c): c for c in candidates.get(best[0], ())}
        if best[1] not in by_repr:
            lines.append(
                f"{tile_key}: fastest {best[1]} is not a candidate of this version: kept the heuristic"
            )
            continue
        cand = by_repr[best[1]]
        for k, v in override(best[0], cand).items():
            if k == "occupancy":
                occupancy.update(v)
            else:
                tiles[k] = v
        gains[tile_key] = {
            "default_ms": round(totals[default], 4),
            "ms": round(totals[best], 4),
            "candidate": f"{best[0]}={best[1]}",
        }
        lines.append(
            f"{tile_key}: adopted {best[0]}={best[1]}: {totals[default]:.4f} -> {totals[best]:.4f} ms "
            f"({gain:.2f}x)"
        )
    measured = {k: data.get(k) for k in ("tokens", "hidden", "dtype", "variant")}
    return Tuning(
        device=device, n=n, tiles=tiles, occupancy=occupancy, measured=measured, gains=gains, source=source
    ), lines
