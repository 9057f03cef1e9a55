"""Perf history: one JSONL record per benchmark run, regression checks, trend plots.

A record (one line of the history file) is built from a pytest-benchmark JSON file::

    {"date": ..., "commit": ..., "dirty": false, "hardware": "dgx_h100", "versions": {...},
     "settings": {...}, "source": "0001_nightly.json",
     "benchmarks": [{"key": "sinkhorn::test_sinkhorn[T512-n4]", "group": "sinkhorn",
                     "name": "test_sinkhorn[T512-n4]", "params": {...}, "median_s": 1.2e-4,
                     "mean_s": ..., "stddev_s": ..., "rounds": 100, "extra_info": {"bytes_per_s": ...}}]}

`check_history` compares the newest record's median time per benchmark against the median
of the previous `window` records of the same hardware key that have it: slower than
`baseline * (1 + band_slow)` is a regression; faster than `baseline * (1 - band_fast)` is
flagged as an improvement (a failure only with `fail_on_improvement`). `settings` is the
suite's own process settings (`machine_info.mhc` of the benchmark file: CUDA graphs, heap
retention, the cuTile tuning in force, ...), so a step in a trend can be traced to one of them.
"""

from __future__ import annotations

import fcntl
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.golden.errors import GoldenFormatError
from harness.golden.provenance import package_versions, utc_now
from harness.golden.schema import parse_json

__all__ = [
    "PerfVerdict",
    "append_record",
    "benchmark_list",
    "check_history",
    "format_verdicts",
    "plot_history",
    "read_history",
    "record_from_benchmark_json",
    "save_trend",
    "slug",
    "format_seconds",
]


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def benchmark_list(doc: Any, *, source: str) -> list:
    """The `benchmarks` list of a parsed pytest-benchmark JSON document; `GoldenFormatError` naming
    `source` when it has none."""
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise GoldenFormatError(f"{source}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    return doc["benchmarks"]


def record_from_benchmark_json(
    doc: Any, *, source: str, hw: str, commit: str | None = None, versions: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Build a history record from a parsed pytest-benchmark JSON document; errors name `source`."""
    if not benchmark_list(doc, source=source):
        raise GoldenFormatError(f"{source}: 'benchmarks' is empty")
    commit_info = doc.get("commit_info") if isinstance(doc.get("commit_info"), dict) else {}
    benches = []
    for i, b in enumerate(doc["benchmarks"]):
        stats = b.get("stats") if isinstance(b, dict) else None
        if not isinstance(stats, dict) or not isinstance(b.get("name"), str):
            raise GoldenFormatError(f"{source}: benchmarks[{i}] lacks 'name' or 'stats'")
        if not _num(stats.get("median")) or stats["median"] <= 0:
            raise GoldenFormatError(
                f"{source}: benchmarks[{i}] ({b['name']}): stats.median={stats.get('median')!r} "
                "must be a finite number > 0"
            )
        where = f"{source}: benchmarks[{i}] ({b['name']})"
        extra = b.get("extra_info") or {}
        if not isinstance(extra, dict):
            raise GoldenFormatError(f"{where}: extra_info={extra!r} must be an object")
        for k in ("mean", "stddev"):
            if stats.get(k) is not None and not _num(stats[k]):
                raise GoldenFormatError(f"{where}: stats.{k}={stats[k]!r} must be a finite number")
        bad = {k: v for k, v in extra.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            raise GoldenFormatError(f"{where}: extra_info holds non-finite values {bad}")
        group = b.get("group")
        benches.append(
            {
                "key": f"{group or 'ungrouped'}::{b['name']}",
                "group": group,
                "name": b["name"],
                "fullname": b.get("fullname"),
                "params": b.get("params"),
                "median_s": float(stats["median"]),
                "mean_s": stats.get("mean"),
                "stddev_s": stats.get("stddev"),
                "rounds": stats.get("rounds"),
                "extra_info": extra,
            }
        )
    machine = doc.get("machine_info")
    settings = machine.get("mhc") if isinstance(machine, dict) else None
    return {
        "date": doc.get("datetime") or utc_now(),
        "commit": commit or commit_info.get("id"),
        "dirty": commit_info.get("dirty"),
        "hardware": hw,
        "versions": dict(versions) if versions is not None else package_versions(),
        "settings": dict(settings) if isinstance(settings, dict) else {},
        "source": Path(source).name,
        "benchmarks": benches,
    }


def append_record(history: str | Path, record: Mapping[str, Any]) -> None:
    """Append one record as one line, under an exclusive lock on the history file."""
    try:
        line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise GoldenFormatError(f"record for {history}: {exc}") from None
    history = Path(history)
    history.parent.mkdir(parents=True, exist_ok=True)
    with open(history, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        f.seek(0, 2)
        if f.tell() > 0:
            f.seek(-1, 2)
            if f.read(1) != b"\n":  # a writer killed mid-line: appending would corrupt this record too
                raise GoldenFormatError(
                    f"{history}: the last line is incomplete (no newline at the end); "
                    "repair or remove it before appending; nothing written"
                )
        f.write(line.encode("utf-8"))
        f.flush()


def read_history(history: str | Path) -> list[dict[str, Any]]:
    """All records, oldest first; a malformed line is an error naming the file and line number."""
    history = Path(history)
    out = []
    for n, line in enumerate(history.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        rec = parse_json(line, source=f"{history} line {n}")
        if not isinstance(rec, dict) or not isinstance(rec.get("benchmarks"), list) or "hardware" not in rec:
            raise GoldenFormatError(f"{history} line {n}: not a perf-history record")
        for i, b in enumerate(rec["benchmarks"]):
            where = f"{history} line {n}: benchmarks[{i}]"
            if (
                not isinstance(b, dict)
                or not isinstance(b.get("key"), str)
                or not isinstance(b.get("name"), str)
            ):
                raise GoldenFormatError(f"{where}: not a benchmark (an object with 'key' and 'name' strings)")
            if not _num(b.get("median_s")) or b["median_s"] <= 0:
                raise GoldenFormatError(
                    f"{where} ({b['key']}): median_s={b.get('median_s')!r} must be a finite number > 0"
                )
            if not isinstance(b.get("extra_info", {}), dict):
                raise GoldenFormatError(f"{where} ({b['key']}): extra_info must be an object")
        out.append(rec)
    return out


@dataclass(frozen=True, kw_only=True)
class PerfVerdict:
    """The newest median of one benchmark against its trailing baseline."""

    key: str
    status: Literal["ok", "regression", "improved", "no_baseline"]
    measured_s: float
    baseline_s: float | None
    n_baseline: int
    band_slow: float
    band_fast: float
    extra_info: dict[str, Any]

    @property
    def delta(self) -> float | None:
        return None if self.baseline_s is None else self.measured_s / self.baseline_s - 1


def check_history(
    records: Sequence[Mapping[str, Any]], *, window: int = 5, band_slow: float = 0.10, band_fast: float = 0.20
) -> list[PerfVerdict]:
    """Verdicts for every benchmark of the newest record (see the module docstring)."""
    if window < 1:
        raise ValueError(f"window={window!r} must be >= 1")
    for name, v in (("band_slow", band_slow), ("band_fast", band_fast)):
        if not _num(v) or v < 0:
            raise ValueError(f"{name}={v!r} must be a finite number >= 0")
    if band_fast >= 1:
        raise ValueError(f"band_fast={band_fast!r} must be < 1 (a time cannot drop by 100 % or more)")
    if not records:
        raise ValueError("the history has no records")
    newest = records[-1]
    if not newest["benchmarks"]:
        raise ValueError(
            f"the newest record ({newest.get('date')}, {newest.get('hardware')}) has no benchmarks"
        )
    prev = [r for r in records[:-1] if r.get("hardware") == newest.get("hardware")]
    out = []
    for b in newest["benchmarks"]:
        hist = [x["median_s"] for r in prev for x in r["benchmarks"] if x["key"] == b["key"]][-window:]
        base = statistics.median(hist) if hist else None
        m = b["median_s"]
        status: Literal["ok", "regression", "improved", "no_baseline"] = "no_baseline"
        if base is not None:
            status = (
                "regression"
                if m > base * (1 + band_slow)
                else "improved"
                if m < base * (1 - band_fast)
                else "ok"
            )
        out.append(
            PerfVerdict(
                key=b["key"],
                status=status,
                measured_s=m,
                baseline_s=base,
                n_baseline=len(hist),
                band_slow=band_slow,
                band_fast=band_fast,
                extra_info=dict(b.get("extra_info") or {}),
            )
        )
    return out


def format_seconds(s: float) -> str:
    """`1.234 ms` / `56.7 us`: a benchmark time as the reports print it."""
    return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} us"


def slug(text: str) -> str:
    """`text` with every run of characters outside `[A-Za-z0-9_.-]` made one `_` (file names of the plots)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def format_verdicts(verdicts: Sequence[PerfVerdict]) -> str:
    """One line per benchmark: status, key, measured, baseline, delta, band (and extra_info figures)."""
    lines = []
    for v in verdicts:
        band = f"band -{v.band_fast:.0%}..+{v.band_slow:.0%}"
        if v.baseline_s is None:
            body = f"measured {format_seconds(v.measured_s)}, no baseline yet (no earlier record on this hardware)"
        else:
            body = (
                f"measured {format_seconds(v.measured_s)}, baseline {format_seconds(v.baseline_s)} (median of {v.n_baseline}), "
                f"delta {v.delta:+.1%}, {band}"
            )
            if v.status == "improved":
                body += " -> faster than the band: check the change and refresh expectations"
        extra = ", ".join(f"{k}={val:.4g}" if _num(val) else f"{k}={val}" for k, val in v.extra_info.items())
        lines.append(f"{v.status.upper():<12} {v.key}: {body}" + (f" [{extra}]" if extra else ""))
    return "\n".join(lines)


def save_trend(
    records: Sequence[Mapping[str, Any]],
    lines: Mapping[str, Sequence[tuple[int, float]]],
    path: Path,
    *,
    ylabel: str,
    title: str,
    reference: float | None = None,
) -> Path:
    """One trend PNG at `path`: a line per `{name: [(record index, value)]}`, the records' dates on the x
    axis, and a dashed horizontal line at `reference` when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, pts in sorted(lines.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8, linestyle="--")
    idx = sorted({p[0] for pts in lines.values() for p in pts})
    ax.set_xticks(
        idx, [str(records[i].get("date", i))[:10] for i in idx], rotation=45, ha="right", fontsize=7
    )
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path)
    return path


def plot_history(records: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """One trend PNG per (hardware, group): median time per record, one line per benchmark."""
    if not records:
        raise ValueError("the history has no records: nothing to plot")
    series: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = {}
    for i, r in enumerate(records):
        for b in r["benchmarks"]:
            key = (str(r.get("hardware")), str(b.get("group") or "ungrouped"))
            series.setdefault(key, {}).setdefault(b["name"], []).append((i, b["median_s"] * 1e3))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        save_trend(
            records,
            lines,
            out_dir / f"perf_{slug(hw)}_{slug(group)}.png",
            ylabel="median time [ms]",
            title=f"{group} on {hw}",
        )
        for (hw, group), lines in sorted(series.items())
    ]
