"""Kernel times from an Nsight Systems SQLite export (`nsys export --type sqlite`), in-house.

Two queries over the tables every export has:

- `kernel_summary`: per kernel name (`StringIds` via `demangledName`, else `shortName`), the
  count and total / min / max GPU time from `CUPTI_ACTIVITY_KIND_KERNEL`.
- `nvtx_kernel_seconds`: per NVTX push/pop or start/end range (`NVTX_EVENTS`, text inline or via
  `textId`), the GPU time of the kernels *launched* inside it: runtime API calls
  (`CUPTI_ACTIVITY_KIND_RUNTIME`) on the range's thread between its start and end, joined to
  their kernels by `correlationId`. Gaps between kernels do not count (unlike a span).

Usage: `python -m suites.perf.nsys report.sqlite` prints both as Markdown. The perf suite reads
a previous profiled run's export when `MHC_NSYS_SQLITE=<path>` is set (see `conftest.py`): each
GPU benchmark wraps every timed call in an NVTX range named `mhc-perf:<case>-<direction>-<backend>`.
"""

from __future__ import annotations

import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KernelStat", "RangeStat", "kernel_summary", "nvtx_kernel_seconds", "RANGE_PREFIX", "main"]

RANGE_PREFIX = "mhc-perf:"
_NVTX_RANGE_TYPES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange


@dataclass(frozen=True, kw_only=True)
class KernelStat:
    """One kernel name: how often it ran and its GPU time in seconds."""

    name: str
    count: int
    total_s: float
    min_s: float
    max_s: float


@dataclass(frozen=True, kw_only=True)
class RangeStat:
    """One NVTX range name: how many instances and the GPU time of the kernels launched inside them."""

    name: str
    instances: int
    kernels: int
    kernel_s: float

    @property
    def per_instance_s(self) -> float:
        return self.kernel_s / self.instances if self.instances else 0.0


def _connect(path: str | Path) -> sqlite3.Connection:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"nsys sqlite: {p} does not exist or is not a file")
    con = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    missing = {"CUPTI_ACTIVITY_KIND_KERNEL", "StringIds"} - tables
    if missing:
        con.close()
        raise ValueError(
            f"nsys sqlite: {p} lacks table(s) {', '.join(sorted(missing))}; is it an nsys export?"
        )
    return con


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def kernel_summary(path: str | Path) -> list[KernelStat]:
    """Per kernel name: count and GPU seconds, the most expensive first."""
    con = _connect(path)
    try:
        cols = _columns(con, "CUPTI_ACTIVITY_KIND_KERNEL")
        name_col = (
            "COALESCE(k.demangledName, k.shortName)"
            if {"demangledName", "shortName"} <= cols
            else ("k.demangledName" if "demangledName" in cols else "k.shortName")
        )
        rows = con.execute(
            f"""SELECT s.value, COUNT(*), SUM(k.end - k.start), MIN(k.end - k.start), MAX(k.end - k.start)
                FROM CUPTI_ACTIVITY_KIND_KERNEL AS k JOIN StringIds AS s ON s.id = {name_col}
                GROUP BY s.value ORDER BY SUM(k.end - k.start) DESC"""
        ).fetchall()
    finally:
        con.close()
    return [
        KernelStat(name=r[0], count=r[1], total_s=r[2] * 1e-9, min_s=r[3] * 1e-9, max_s=r[4] * 1e-9)
        for r in rows
    ]


def nvtx_kernel_seconds(path: str | Path, prefix: str = "") -> dict[str, RangeStat]:
    """Per NVTX range name (starting with `prefix`): instances and the GPU time of kernels launched inside."""
    con = _connect(path)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME"} <= tables:
            return {}
        text = "COALESCE(n.text, t.value)" if "textId" in _columns(con, "NVTX_EVENTS") else "n.text"
        join_text = (
            "LEFT JOIN StringIds AS t ON t.id = n.textId" if "textId" in _columns(con, "NVTX_EVENTS") else ""
        )
        ranges = con.execute(
            f"""SELECT n.rowid, {text} AS name, n.start, n.end, n.globalTid FROM NVTX_EVENTS AS n {join_text}
                WHERE n.eventType IN ({",".join(map(str, _NVTX_RANGE_TYPES))}) AND n.end IS NOT NULL"""
        ).fetchall()
        out: dict[str, list[int | float]] = {}
        for _, name, start, end, tid in ranges:
            if name is None or not name.startswith(prefix):
                continue
            kernels, ns = con.execute(
                """SELECT COUNT(k.start), COALESCE(SUM(k.end - k.start), 0)
                   FROM CUPTI_ACTIVITY_KIND_RUNTIME AS r
                   JOIN CUPTI_ACTIVITY_KIND_KERNEL AS k ON k.correlationId = r.correlationId
                   WHERE r.globalTid = ? AND r.start >= ? AND r.start <= ?""",
                (tid, start, end),
            ).fetchone()
            acc = out.setdefault(name, [0, 0, 0])
            acc[0] += 1
            acc[1] += kernels
            acc[2] += ns
    finally:
        con.close()
    return {k: RangeStat(name=k, instances=v[0], kernels=v[1], kernel_s=v[2] * 1e-9) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m suites.perf.nsys <export.sqlite>", file=sys.stderr)
        return 2
    print("| kernel | count | total ms | min us | max us |\n|---|---|---|---|---|")
    for k in kernel_summary(args[0]):
        print(f"| {k.name} | {k.count} | {k.total_s * 1e3:.3f} | {k.min_s * 1e6:.1f} | {k.max_s * 1e6:.1f} |")
    ranges = nvtx_kernel_seconds(args[0])
    if ranges:
        print("\n| NVTX range | instances | kernels | kernel us per instance |\n|---|---|---|---|")
        for r in sorted(ranges.values(), key=lambda r: r.name):
            print(f"| {r.name} | {r.instances} | {r.kernels} | {r.per_instance_s * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
