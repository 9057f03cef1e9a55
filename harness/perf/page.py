"""The nightly summary page: one Markdown page per hardware key from the perf history and its trend PNGs.

`mhc-harness perf-history plot --history H --out DIR` writes `DIR/<hw>.md` beside the PNGs: the
newest record's table (op, direction, backend, shape, median, roofline ratio, speed-up, the verdict
against the trailing median with regressions in bold), each group's trend plot, and the points of
the history (date, commit, dirty flag, torch / CUDA / cuda-tile versions, how many benchmarks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.perf.history import PerfVerdict, check_history, format_seconds, slug

__all__ = ["write_pages"]


def _verdict(v: PerfVerdict) -> str:
    if v.baseline_s is None:
        return "first point"
    text = f"{v.delta:+.1%} vs median of {v.n_baseline}"
    return (
        f"**REGRESSION {text}**"
        if v.status == "regression"
        else (f"improved {text}" if v.status == "improved" else f"ok {text}")
    )


def _page(hw: str, records: Sequence[Mapping[str, Any]], pngs: Sequence[Path], out_dir: Path) -> str:
    newest = records[-1]
    verdicts = {v.key: v for v in check_history(records)}
    regressions = [v for v in verdicts.values() if v.status == "regression"]
    md = [
        f"# Nightly perf: {hw}",
        "",
        f"Newest run {str(newest.get('date', '?'))[:19]} at commit `{str(newest.get('commit', '?'))[:12]}`"
        f"{' (dirty tree)' if newest.get('dirty') else ''}; {len(records)} run(s) in the history; "
        f"**{len(regressions)} regression(s)** against the trailing median (band +10 %).",
        "",
        "## Newest run",
        "",
        "| op | dir | backend | shape | median | roofline | vs reference | vs history |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in sorted(newest["benchmarks"], key=lambda b: b["key"]):
        e = b.get("extra_info") or {}
        roof = (
            f"{e['roofline_ratio'] * 100:.0f} %" if isinstance(e.get("roofline_ratio"), int | float) else "-"
        )
        speed = (
            f"{e['speedup_vs_reference']:.2f}x"
            if isinstance(e.get("speedup_vs_reference"), int | float)
            else "-"
        )
        shape = str(e.get("shape", "-")).removeprefix(f"{e.get('op', '')}-")
        md.append(
            f"| {e.get('op', b.get('group', '-'))} | {e.get('direction', '-')} | {e.get('backend', '-')} | "
            f"{shape} | {format_seconds(b['median_s'])} | {roof} | {speed} | {_verdict(verdicts[b['key']])} |"
        )
    md += ["", "## Trends", ""]
    md += [f"![{p.stem}]({p.relative_to(out_dir).as_posix()})\n" for p in pngs] or [
        "No plot (one point per benchmark)."
    ]
    md += [
        "",
        "## Points",
        "",
        "| date | commit | dirty | torch | CUDA | cuda-tile | benchmarks |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        v = r.get("versions") or {}
        md.append(
            f"| {str(r.get('date', '?'))[:19]} | `{str(r.get('commit', '?'))[:12]}` | "
            f"{'yes' if r.get('dirty') else 'no'} | {v.get('torch', '-')} | {v.get('cuda', '-')} | "
            f"{v.get('cuda-tile', '-')} | {len(r['benchmarks'])} |"
        )
    return "\n".join(md) + "\n"


def write_pages(
    records: Sequence[Mapping[str, Any]], pngs: Sequence[Path], out_dir: str | Path
) -> list[Path]:
    """`<out_dir>/<hw>.md` per hardware key of `records` (its own records, its own PNGs)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for hw in sorted({str(r.get("hardware")) for r in records}):
        mine = [r for r in records if str(r.get("hardware")) == hw]
        own = [p for p in pngs if p.name.startswith(f"perf_{slug(hw)}_")]
        path = out_dir / f"{slug(hw)}.md"
        path.write_text(_page(hw, mine, own, out_dir), encoding="utf-8")
        paths.append(path)
    return paths
