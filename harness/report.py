"""Reports of a `mhc-harness run`: summary table (terminal), Markdown report and plots.

`write_report` writes `report.md` into the output directory with the per-suite pytest
counts, one row per golden check (suite, case, metric, status, worst delta), the failure
messages, and PNGs under `plots/`: golden vs actual loss curves per case, and baseline vs mHC
overlays for case pairs named by `harness.plots.mhc_pairs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.golden.errors import GoldenError
from harness.golden.provenance import utc_now
from harness.golden.results import CaseOutcome, load_actual
from harness.golden.schema import Golden, load_golden
from harness.plots import hc_pairs, loss_metrics, mhc_pairs, plot_case, plot_overlay, stability_metrics
from harness.runner import RunSummary
from harness.upstream.tree_report import markdown as tree_markdown
from harness.upstream.tree_report import read_rows as read_tree_rows

__all__ = ["format_table", "step_time_ratios", "summary_rows", "write_plots", "write_report"]

STEP_TIME_METRIC = "iteration-time"
WARMUP_STEPS = 3
"""Steps skipped before the step-time median (compilation, allocator and cache warm-up)."""

_HEADER = ("suite", "case", "metric", "check", "status", "worst delta")


def _delta(c) -> str:
    if c.worst_rel is not None:
        where = f" @ step {c.worst_step}" if c.worst_step is not None else " (median)"
        return f"{c.worst_rel:+.3e} rel{where}"
    if c.worst_delta is not None:
        return f"{c.worst_delta:+.4g} abs"
    return "-"


def summary_rows(cases: Sequence[CaseOutcome]) -> list[tuple[str, ...]]:
    """One row per check (or one per case without checks): suite, case, metric, check, status, worst delta."""
    rows: list[tuple[str, ...]] = []
    for o in cases:
        status = o.status + (" (rewritten)" if o.rewritten and o.status != "written" else "")
        if not o.checks:
            rows.append((o.suite, o.case, "-", "-", status, "-"))
        for c in o.checks:
            rows.append((o.suite, o.case, c.metric, c.check, c.status, _delta(c)))
    return rows


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str] = _HEADER) -> str:
    """A fixed-width text table."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [line.format(*header), line.format(*("-" * w for w in widths)), *(line.format(*r) for r in rows)]
    )


def _slug(*parts: str) -> str:
    return "__".join(p.replace("/", "_").replace(" ", "_") for p in parts)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def step_time_ratios(actuals: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, float, float, float]]:
    """`(suite, baseline, mhc, baseline median s, mhc median s, ratio)` for every baseline / mHC pair
    whose results both carry `iteration-time` (median after `WARMUP_STEPS` steps)."""
    rows = []
    for suite, cases in actuals.items():
        for base, mhc in mhc_pairs(cases):
            series = [cases[c].get(STEP_TIME_METRIC) for c in (base, mhc)]
            if any(s is None for s in series):
                continue
            meds = []
            for s in series:
                steps = sorted(s.values)
                kept = [s.values[k] for k in steps[WARMUP_STEPS:]] or [s.values[k] for k in steps]
                meds.append(_median(kept))
            if meds[0] > 0:
                rows.append((suite, base, mhc, meds[0], meds[1], meds[1] / meds[0]))
    return rows


def _actuals(summary: RunSummary) -> dict[str, dict[str, Golden]]:
    by_suite: dict[str, dict[str, Golden]] = {}
    for o in summary.cases:
        try:
            actual = load_actual(summary.results_dir, o.suite, o.case)
        except GoldenError:
            continue
        if actual is not None:
            by_suite.setdefault(o.suite, {})[o.case] = actual
    return by_suite


def write_plots(summary: RunSummary, plots_dir: Path) -> list[tuple[str, Path]]:
    """Golden-vs-actual loss curves per case and baseline-vs-mHC overlays; returns `(caption, png)`."""
    out: list[tuple[str, Path]] = []
    by_suite: dict[str, dict[str, Golden]] = {}
    for o in summary.cases:
        try:
            actual = load_actual(summary.results_dir, o.suite, o.case)
            golden = load_golden(o.golden_path) if o.golden_path and Path(o.golden_path).is_file() else None
        except GoldenError:
            continue
        if actual is None:
            continue
        by_suite.setdefault(o.suite, {})[o.case] = actual
        metrics = loss_metrics(actual) + stability_metrics(actual)
        if metrics:
            png = plot_case(
                actual,
                golden,
                metrics=metrics,
                path=plots_dir / f"{_slug(o.suite, o.case)}.png",
                title=f"{o.suite}/{o.case} on {o.hw}: golden vs actual",
            )
            out.append((f"{o.suite}/{o.case}: golden vs actual", png))
    for suite, cases in by_suite.items():
        for base, mhc in mhc_pairs(cases):
            for m in loss_metrics(cases[mhc]):
                if m in cases[base]:
                    png = plot_overlay(
                        {base: cases[base][m], mhc: cases[mhc][m]},
                        metric=m,
                        path=plots_dir / f"{_slug(suite, base, 'vs', mhc, m)}.png",
                        title=f"{suite}: {base} vs {mhc} ({m})",
                    )
                    out.append((f"{suite}: {base} vs {mhc} ({m})", png))
        for hc, mhc in hc_pairs(cases):  # the paper's stability figure: HC's gain against mHC's
            for m in stability_metrics(cases[mhc]):
                if m in cases[hc]:
                    png = plot_overlay(
                        {hc: cases[hc][m], mhc: cases[mhc][m]},
                        metric=m,
                        path=plots_dir / f"{_slug(suite, hc, 'vs', mhc, m)}.png",
                        title=f"{suite}: {hc} (unconstrained) vs {mhc} ({m})",
                    )
                    out.append((f"{suite}: {hc} vs {mhc} ({m})", png))
    return out


def write_report(summary: RunSummary, out_dir: str | Path, *, plots: bool = True) -> Path:
    """Write `<out_dir>/report.md` (and PNGs under `<out_dir>/plots`); returns the report path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = [
        "# mHC harness report",
        "",
        f"- date: {utc_now()}",
        f"- hardware key: {summary.hw or '(detected per run)'}",
        f"- golden dir: `{summary.golden_dir}`",
        f"- result: **{'PASS' if summary.ok else 'FAIL'}**",
        "",
        "## Suites",
        "",
        "| suite | pytest exit | tests | failures | errors | skipped | JUnit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary.runs:
        md.append(
            f"| {r.suite} | {r.returncode} | {r.tests} | {r.failures} | {r.errors} | {r.skipped} | "
            f"`{r.junit.name}` |"
        )
    md += ["", "## Golden checks", ""]
    rows = summary_rows(summary.cases)
    if rows:
        md += ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
        md += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        md.append("No case handed metrics to `golden_metrics`.")
    decided = [o for o in summary.cases if o.lane]
    if decided:
        md += [
            "",
            "## Which lane decided",
            "",
            "`exact` where this run's numerics fingerprint has exact values for the case, else the "
            "approximate lane (the exact check reports `n/a`); `mhc-harness recalibrate <suite> <case> "
            "--exact-only` adds this machine's.",
            "",
            "| suite | case | decided by | why |",
            "|---|---|---|---|",
        ]
        md += [f"| {o.suite} | {o.case} | {o.lane} | {o.lane_reason or '-'} |" for o in decided]
    failed = [o for o in summary.cases if o.failed]
    bad_runs = [r for r in summary.runs if not r.ok]
    if failed or bad_runs:
        md += ["", "## Failures", ""]
        for o in failed:
            md += [f"### {o.suite}/{o.case} ({o.status})", "", "```text", o.message, "```", ""]
        for r in bad_runs:
            md += [
                f"### pytest {r.suite} (exit {r.returncode})",
                "",
                "```text",
                r.output_tail[-2500:],
                "```",
                "",
            ]
    ratios = step_time_ratios(_actuals(summary))
    if ratios:
        md += [
            "",
            "## mHC step time vs baseline",
            "",
            f"Median `{STEP_TIME_METRIC}` after {WARMUP_STEPS} warm-up steps, measured in this run.",
            "",
            "| suite | baseline | mHC | baseline s | mHC s | mHC / baseline |",
            "|---|---|---|---|---|---|",
        ]
        md += [f"| {su} | {b} | {m} | {tb:.4g} | {tm:.4g} | {r:.3f} |" for su, b, m, tb, tm, r in ratios]
    tree_rows = tree_markdown(read_tree_rows(summary.results_dir, [r.suite for r in summary.runs]))
    if tree_rows:
        md += ["", *tree_rows]
    conformance = out_dir / "conformance.md"
    if conformance.is_file():
        md += ["", conformance.read_text(encoding="utf-8").rstrip()]
    if plots:
        pngs = write_plots(summary, out_dir / "plots")
        if pngs:
            md += ["", "## Plots", ""]
            md += [f"![{cap}]({png.relative_to(out_dir).as_posix()})\n" for cap, png in pngs]
    path = out_dir / "report.md"
    path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return path
