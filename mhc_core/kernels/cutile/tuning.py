"""Tuned tiles per GPU model: a tile sweep's winners as a JSON file, found by device name.

    python -m tools.cutile.sweep --out sweep.json                    # GPU: time every candidate
    python -m tools.cutile.sweep --adopt sweep.json --out tuning.json  # no GPU: keep the winners
    MHC_CUTILE_TUNING=tuning.json python train.py                               # run with them

Which tuning is in force (`resolve`, on the GPU runtime's first launch; logged once on
`mhc_core.kernels`): `MHC_CUTILE_TUNING` set to a path (that file; a missing or malformed file is
an error naming it) or to `off` (none); unset, the file shipped for the device,
`tuned/<device_slug(torch.cuda.get_device_name())>.json`, when there is one; else none, and the
heuristics of `tiling` decide. A tuning's tiles apply at its `n` only (`tiling`).

File, schema 1 (`Tuning.to_json`): `device` (the name it was swept on), `n`, `measured` (the
sweep's shape, dtype, variant), `tiles` (`{tile key: {type name: fields}}`), `occupancy`
(`{kernel name: CTAs per SM}`), `gains` (per adopted key: the default's and the winner's GPU ms).

`python -m tools.cutile.tiles [FILE] [--device NAME] [--n 4 --hidden 4096]` (the lab) prints the
tiles in force against the heuristics (no GPU needed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mhc_core.kernels.cutile import tiling

__all__ = [
    "ENV",
    "SCHEMA",
    "TUNED_DIR",
    "REFERENCE_DEVICE",
    "Tuning",
    "device_slug",
    "load",
    "save",
    "packaged",
    "resolve",
    "describe",
    "write_json",
]

ENV = "MHC_CUTILE_TUNING"
SCHEMA = 1
TUNED_DIR = Path(__file__).parent / "tuned"
"""The tunings shipped with the package, one `<device_slug>.json` per GPU model."""
REFERENCE_DEVICE = "NVIDIA H200"
"""The GPU model the heuristics were tuned on and the lent GPU machine has (the tools' default `--device`)."""

logger = logging.getLogger("mhc_core.kernels")


def device_slug(name: str) -> str:
    """File stem for a device name: `NVIDIA H200` -> `nvidia_h200`."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """Tiles and occupancy hints that beat the heuristics on one GPU model, at `n` streams."""

    device: str
    n: int
    tiles: Mapping[str, Any] = field(default_factory=dict)
    occupancy: Mapping[str, int] = field(default_factory=dict)
    measured: Mapping[str, Any] = field(default_factory=dict)
    gains: Mapping[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"cuTile tuning {self.source}" if self.source else f"cuTile tuning for {self.device!r}"
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise ValueError(f"{where}: n={self.n!r} must be an integer")
        if self.n not in tiling.SUPPORTED_N:
            raise ValueError(f"{where}: n={self.n!r}; kernels exist for n in {tiling.SUPPORTED_N}")
        for key, tile in self.tiles.items():
            if key == "occupancy":
                raise ValueError(f"{where}: occupancy hints go under 'occupancy', not 'tiles'")
            tiling.check_tile(key, tile, where)
        tiling.check_tile("occupancy", self.occupancy, where)

    def digest(self) -> str:
        """First 12 hex digits of the SHA-256 of the file's canonical contents (what identifies a tuning
        wherever its file lies)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:12]

    def to_json(self) -> dict:
        """The file's contents (schema 1)."""
        return {
            "schema": SCHEMA,
            "device": self.device,
            "n": self.n,
            "measured": dict(self.measured),
            "tiles": {k: {type(t).__name__: tiling.tile_fields(t)} for k, t in self.tiles.items()},
            "occupancy": dict(self.occupancy),
            "gains": dict(self.gains),
        }

    @classmethod
    def from_json(cls, data: object, source: str) -> Tuning:
        """Parse a file's contents; `ValueError` naming `source` and the bad entry."""
        where = f"cuTile tuning {source}"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{where}: schema {data.get('schema')!r}, this version reads schema {SCHEMA}")
        missing = [k for k in ("device", "n", "tiles") if k not in data]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        not_objects = [
            k for k in ("tiles", "occupancy", "measured", "gains") if not isinstance(data.get(k, {}), dict)
        ]
        if not_objects:
            raise ValueError(f"{where}: {', '.join(not_objects)} must be JSON objects")
        tiles = {}
        for key, spec in data["tiles"].items():
            if not (
                isinstance(spec, dict)
                and len(spec) == 1
                and next(iter(spec)) in tiling.TILE_TYPES
                and isinstance(next(iter(spec.values())), dict)
            ):
                raise ValueError(
                    f"{where}: tiles[{key!r}] = {spec!r}: expected {{type: fields}} with a type "
                    f"from {', '.join(tiling.TILE_TYPES)}"
                )
            ((name, values),) = spec.items()
            kind = tiling.TILE_TYPES[name]
            unknown = set(values) - {f.name for f in fields(kind)}
            if unknown:
                raise ValueError(
                    f"{where}: tiles[{key!r}]: {name} has no field(s) {', '.join(sorted(unknown))} "
                    "(formulations the kernels no longer have: tools/cutile/retired.py)"
                )
            try:
                tiles[key] = kind(**values)
            except TypeError as exc:
                raise ValueError(f"{where}: tiles[{key!r}]: {exc}") from None
        return cls(
            device=str(data["device"]),
            n=data["n"],
            tiles=tiles,
            occupancy=dict(data.get("occupancy", {})),
            measured=dict(data.get("measured", {})),
            gains=dict(data.get("gains", {})),
            source=source,
        )


def load(path: str | os.PathLike) -> Tuning:
    """Read a tuning file; `ValueError` naming the path when it is missing, not JSON or not a tuning."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cuTile tuning {p}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"cuTile tuning {p}: not JSON: {exc}") from None
    return Tuning.from_json(data, str(p))


def save(tuning: Tuning, path: str | os.PathLike) -> None:
    """Write `tuning` to `path` atomically."""

    write_json(str(path), tuning.to_json())


def packaged(device_name: str) -> Tuning | None:
    """The tuning shipped for `device_name` (`TUNED_DIR/<device_slug>.json`), or None."""
    p = TUNED_DIR / f"{device_slug(device_name)}.json"
    return load(p) if p.is_file() else None


def resolve(device_name: str | None) -> Tuning | None:
    """The tuning to use on `device_name` (None: no device, so only `MHC_CUTILE_TUNING` counts)."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "none", "0"):
        return None
    if value:
        t = load(value)
        if device_name is not None and device_slug(t.device) != device_slug(device_name):
            logger.warning("cuTile tuning %s was swept on %s; this is %s", value, t.device, device_name)
        return t
    return packaged(device_name) if device_name else None


def describe(tuning: Tuning | None) -> str:
    """One line: which tuning is in force (file name, content digest, what it sets)."""
    if tuning is None:
        return "none (tiling heuristics)"
    keys = ", ".join(tuning.tiles) or "no tiles"
    hints = f", {len(tuning.occupancy)} occupancy hint(s)" if tuning.occupancy else ""
    name = Path(tuning.source).name if tuning.source else "in memory"  # no machine paths in records
    return f"{name} sha256:{tuning.digest()} ({tuning.device}, n = {tuning.n}: {keys}{hints})"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str, data: dict) -> None:
    """`data` as the JSON file `path`, replaced atomically (a reader never sees half a file): the tuning
    files and the GPU tools' `--out` files."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would otherwise be the file's mode
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:  # nothing left behind on the way to an error
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
