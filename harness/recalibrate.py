"""Recalibration: run a case N times, average, show what moved, then write atomically.

The procedure (:func:`recalibrate`):

1. refuse an unknown hardware key (unless allowed) before running anything;
2. read the old golden file (a missing one is fine; a broken one is an error);
3. run the case ``repeats`` times; refuse a failed run, non-finite values, or repeats whose
   metrics or steps differ;
4. average per step (identical repeats keep their exact value, so a deterministic case stays
   bit-exact) and record the per-step spread (min, max, std) for the meta file;
5. with ``only_failing``, stop when the old golden file still passes every repeat;
6. print, per metric, the signed mean relative change ``mean((old - new) / old)`` (upstream's
   ``compare_golden_values``; steps where old is 0 are skipped) and the max abs difference;
7. only then write json and meta under the case lock (unless ``dry_run``).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.case_check import normalize_checks
from harness.compare import Check, compare
from harness.errors import GoldenFormatError, MissingGoldenError, NonFiniteError, RecalibrationError
from harness.hardware import HardwareKey, require_known
from harness.schema import Golden, MetricSeries, check_finite, to_golden
from harness.store import GoldenStore, build_meta, validate_name

__all__ = ["Repeat", "RecalibrationResult", "aggregate", "change_lines", "mean_relative_change", "recalibrate"]


@dataclass(frozen=True, kw_only=True)
class Repeat:
    """One run of a case: its metrics and, when the runner compared them, whether the old golden passed."""

    metrics: Mapping[str, Any]
    golden_passed: bool | None = None


Runner = Callable[[int], "Mapping[str, Any] | Repeat"]
"""Called with the repeat index (0-based); returns the metrics or a :class:`Repeat`; raises on failure."""


@dataclass(frozen=True, kw_only=True)
class RecalibrationResult:
    """What a recalibration did."""

    golden: Golden
    spread: dict[str, Any]
    changes: tuple[str, ...]
    written: bool
    path: Path
    reason: str


def aggregate(runs: Sequence[Golden], *, label: str) -> tuple[Golden, dict[str, Any]]:
    """Per-step mean over ``runs`` and the spread ``{metric: {max_rel_spread, steps: {step: {min,max,std}}}}``."""
    first = runs[0]
    for i, run in enumerate(runs[1:], start=2):
        if set(run) != set(first):
            raise RecalibrationError(f"{label}: repeat {i} has metrics {sorted(run)}, repeat 1 has {sorted(first)}")
        for m, s in run.items():
            if s.steps != first[m].steps:
                only1 = sorted(set(first[m].steps) - set(s.steps))
                onlyi = sorted(set(s.steps) - set(first[m].steps))
                raise RecalibrationError(f"{label}: metric {m!r} steps differ between repeat 1 and repeat {i}: "
                                         f"only in 1: {only1}, only in {i}: {onlyi}")
    mean: Golden = {}
    spread: dict[str, Any] = {}
    for m, s0 in first.items():
        values: dict[int, float] = {}
        steps: dict[str, Any] = {}
        worst = 0.0
        for step in s0.steps:
            xs = [run[m].values[step] for run in runs]
            mu = xs[0] if all(x == xs[0] for x in xs) else statistics.fmean(xs)
            values[step] = mu
            lo, hi = min(xs), max(xs)
            steps[str(step)] = {"min": lo, "max": hi, "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}
            if mu != 0:
                worst = max(worst, (hi - lo) / abs(mu))
        mean[m] = MetricSeries(start_step=s0.start_step, end_step=s0.end_step, step_interval=s0.step_interval,
                               values=values)
        spread[m] = {"max_rel_spread": worst, "steps": steps}
    return mean, spread


def mean_relative_change(old: MetricSeries, new: MetricSeries) -> tuple[float | None, float, int]:
    """``(mean((old - new) / old), max |old - new|, n)`` over common steps; the mean skips old == 0."""
    common = [s for s in old.steps if s in new.values]
    rel = [(old.values[s] - new.values[s]) / old.values[s] for s in common if old.values[s] != 0]
    mx = max((abs(old.values[s] - new.values[s]) for s in common), default=0.0)
    return (statistics.fmean(rel) if rel else None), mx, len(common)


def change_lines(old: Golden | None, new: Golden) -> list[str]:
    """Per metric: signed mean relative change against ``old``, max abs diff, steps on one side only."""
    if old is None:
        return [f"  {m}: new ({len(s.values)} steps, no previous golden file)" for m, s in new.items()]
    lines = []
    for m in [*new, *(k for k in old if k not in new)]:
        if m not in old:
            lines.append(f"  {m}: new metric ({len(new[m].values)} steps)")
        elif m not in new:
            lines.append(f"  {m}: dropped (in the old golden file, absent from the new values)")
        else:
            mr, mx, n = mean_relative_change(old[m], new[m])
            mr_s = "n/a (old values all 0)" if mr is None else f"{mr:+.6e}"
            extra = sorted(set(old[m].steps) ^ set(new[m].steps))
            tail = f"; steps on one side only: {extra[:10]}{' ...' if len(extra) > 10 else ''}" if extra else ""
            lines.append(f"  {m}: mean((old-new)/old) = {mr_s}, max |old-new| = {mx:.6g} over {n} steps{tail}")
    return lines


def _as_repeat(raw: Mapping[str, Any] | Repeat) -> Repeat:
    return raw if isinstance(raw, Repeat) else Repeat(metrics=raw)


def _require_writable(directory: Path) -> None:
    """`GoldenFormatError` naming the path unless `directory`, or its nearest existing ancestor, is a
    writable directory: checked before the repeats, which can be whole trainings."""
    p = directory
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise GoldenFormatError(f"{p}: not a writable directory, so {directory} cannot hold the new golden "
                                "file; nothing was run")


def recalibrate(*, store: GoldenStore, hw: HardwareKey | str, suite: str, case: str, runner: Runner,
                repeats: int, only_failing: bool = False, checks: Mapping[str, Check | Sequence[Check]] | None = None,
                allow_unknown_hw: bool = False, dry_run: bool = False, out: Callable[[str], None] = print,
                commit_cwd: str | Path | None = None) -> RecalibrationResult:
    """Recalibrate one case (see the module docstring); raises a GoldenError subclass on refusal."""
    key = hw.key if isinstance(hw, HardwareKey) else hw
    rule = hw.rule if isinstance(hw, HardwareKey) else None
    require_known(key, allow_unknown=allow_unknown_hw)
    validate_name(suite, field="suite")
    validate_name(case, field="case")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    norm = normalize_checks(checks) if checks is not None else None
    path = store.files(key, suite, case).json
    label = f"{suite}/{case} on {key}"
    try:
        old, _ = store.load(key, suite, case)
    except MissingGoldenError:
        old = None

    if not dry_run:
        _require_writable(path.parent)
    runs: list[Golden] = []
    passed: list[bool | None] = []
    for i in range(repeats):
        out(f"[{label}] repeat {i + 1}/{repeats} ...")
        rep = _as_repeat(runner(i))
        golden = to_golden(rep.metrics, source=f"{label}, repeat {i + 1}")
        try:
            check_finite(golden, source=f"{label}, repeat {i + 1}")
        except NonFiniteError as exc:
            raise NonFiniteError(f"{exc}; nothing written") from None
        runs.append(golden)
        passed.append(rep.golden_passed)
    new, spread = aggregate(runs, label=label)

    if only_failing and old is not None:
        if norm is not None:
            passed = [all(r.ok for r in compare(run, old, norm, source=str(path))) for run in runs]
        if any(p is None for p in passed):
            raise ValueError("only_failing needs checks (or a runner that reports golden_passed)")
        if all(passed):
            out(f"[{label}] the current golden file passes all {repeats} repeats: not rewritten (--only-failing)")
            return RecalibrationResult(golden=new, spread=spread, changes=(), written=False, path=path,
                                       reason="golden still passes")
    changes = change_lines(old, new)
    out(f"[{label}] change against {'the old file ' + str(path) if old is not None else 'nothing (new case)'}:")
    for line in changes:
        out(line)
    if dry_run:
        out(f"[{label}] dry run: {path} not written")
        return RecalibrationResult(golden=new, spread=spread, changes=tuple(changes), written=False, path=path,
                                   reason="dry run")
    meta = build_meta(hw=key, hw_rule=rule, suite=suite, case=case, golden=new, source="mhc-harness recalibrate",
                      repeats=repeats, spread=spread, commit_cwd=commit_cwd)
    store.write(key, suite, case, new, meta)
    out(f"[{label}] wrote {path} and {path.with_suffix('.meta.json').name} (mean of {repeats} repeats)")
    return RecalibrationResult(golden=new, spread=spread, changes=tuple(changes), written=True, path=path,
                               reason="written")
