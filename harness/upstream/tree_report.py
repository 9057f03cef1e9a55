"""Rows of a Megatron-LM tree's comparisons (tree vs its single process, tree vs ours), for report.md.

The pp and functional suites hand each comparison to `record` (`tree_rows` fixture of the
suites); under `mhc-harness run` (`--mhc-results-dir`) it lands as
`<results>/<suite>/<case>--<comparison>.tree.json` and `markdown` turns the run's rows into
the report's "Megatron-LM tree" table.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["TreeRow", "markdown", "read_rows", "record"]


@dataclass(frozen=True, kw_only=True)
class TreeRow:
    """One comparison: which suite and case, against what, the tree's label, the worst relative
    difference per quantity (`loss`, `grad`, ... or a metric name), and whether it was in bounds."""

    suite: str
    case: str
    comparison: str
    tree: str
    worst: Mapping[str, float] = field(default_factory=dict)
    ok: bool = True
    note: str = ""


def record(results_dir: Path | None, row: TreeRow) -> Path | None:
    """Write `row` under `results_dir` (atomically); nothing without a results directory."""
    if results_dir is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{row.case}--{row.comparison}").strip("-")
    path = Path(results_dir) / row.suite / f"{slug}.tree.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(row), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_rows(results_dir: Path, suites: Sequence[str] | None = None) -> list[TreeRow]:
    """Every row under `results_dir` (optionally only these suites), sorted by suite, case, comparison."""
    rows = []
    for p in sorted(Path(results_dir).glob("*/*.tree.json")):
        if suites is not None and p.parent.name not in suites:
            continue
        doc = json.loads(p.read_text(encoding="utf-8"))
        rows.append(TreeRow(**doc))
    return sorted(rows, key=lambda r: (r.suite, r.case, r.comparison))


def markdown(rows: Sequence[TreeRow]) -> list[str]:
    """The report section: one line per comparison with its worst differences."""
    if not rows:
        return []
    out = [
        "## Megatron-LM tree",
        "",
        "Worst relative difference over every step (pp: every microbatch loss, gradient and updated weight; "
        "functional: each metric per step, in the approximate bands).",
        "",
        "| suite | case | comparison | tree | worst relative difference | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        worst = ", ".join(f"{k} {v:.1e}" for k, v in r.worst.items()) or "-"
        status = ("ok" if r.ok else "**differs**") + (f" ({r.note})" if r.note else "")
        out.append(f"| {r.suite} | {r.case} | {r.comparison} | {r.tree} | {worst} | {status} |")
    return out
