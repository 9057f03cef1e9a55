"""Recalibration: run a case N times, average, show what moved, then write atomically.

The procedure (`recalibrate`):

1. refuse an unknown hardware key (unless allowed) before running anything;
2. read the old golden file (a missing one is fine; a broken one is an error);
3. run the case `repeats` times; refuse a failed run, non-finite values, or repeats whose
   metrics or steps differ;
4. average per step (identical repeats keep their exact value, so a deterministic case stays
   bit-exact) and record the per-step spread (min, max, std) for the meta file;
5. with `only_failing`, stop when the old golden file still passes every repeat;
6. print, per metric, the signed mean relative change `mean((old - new) / old)` (upstream's
   `compare_golden_values`; steps where old is 0 are skipped) and the max abs difference, and
   which other fingerprints' exact sets the new reference drops;
7. only then write json and meta (with the runs' numerics fingerprint) under the case lock
   (unless `dry_run`).

`exact_only` adds this machine's exact values beside the reference instead (`recalibrate`
with `exact_only=True`): the reference and the other fingerprints' sets do not move; the
repeats must agree bit for bit per metric (a metric that does not is left out and named), and a
fingerprint that recorded the reference is refused (its exact values are the reference).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.golden.case_check import normalize_checks
from harness.golden.compare import Check, compare
from harness.golden.errors import GoldenFormatError, MissingGoldenError, NonFiniteError, RecalibrationError
from harness.golden.fingerprint import NumericsFingerprint
from harness.golden.hardware import HardwareKey, require_known
from harness.golden.provenance import git_commit, package_versions, utc_now
from harness.golden.schema import Golden, MetricSeries, check_finite, golden_digest, to_golden
from harness.golden.store import GoldenStore, build_meta, numerics_entry, validate_name

__all__ = [
    "Repeat",
    "RecalibrationResult",
    "aggregate",
    "change_lines",
    "mean_relative_change",
    "recalibrate",
]


@dataclass(frozen=True, kw_only=True)
class Repeat:
    """One run of a case: its metrics and, when the runner compared them, whether the old golden passed."""

    metrics: Mapping[str, Any]
    golden_passed: bool | None = None
    fingerprint: NumericsFingerprint | None = None
    """The numerics fingerprint of the process that computed `metrics` (None: not reported)."""


Runner = Callable[[int], "Mapping[str, Any] | Repeat"]
"""Called with the repeat index (0-based); returns the metrics or a `Repeat`; raises on failure."""


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
    """Per-step mean over `runs` and the spread `{metric: {max_rel_spread, steps: {step: {min,max,std}}}}`."""
    first = runs[0]
    for i, run in enumerate(runs[1:], start=2):
        if set(run) != set(first):
            raise RecalibrationError(
                f"{label}: repeat {i} has metrics {sorted(run)}, repeat 1 has {sorted(first)}"
            )
        for m, s in run.items():
            if s.steps != first[m].steps:
                only1 = sorted(set(first[m].steps) - set(s.steps))
                onlyi = sorted(set(s.steps) - set(first[m].steps))
                raise RecalibrationError(
                    f"{label}: metric {m!r} steps differ between repeat 1 and repeat {i}: "
                    f"only in 1: {only1}, only in {i}: {onlyi}"
                )
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
        mean[m] = MetricSeries(
            start_step=s0.start_step, end_step=s0.end_step, step_interval=s0.step_interval, values=values
        )
        spread[m] = {"max_rel_spread": worst, "steps": steps}
    return mean, spread


def mean_relative_change(old: MetricSeries, new: MetricSeries) -> tuple[float | None, float, int]:
    """`(mean((old - new) / old), max |old - new|, n)` over common steps; the mean skips old == 0."""
    common = [s for s in old.steps if s in new.values]
    rel = [(old.values[s] - new.values[s]) / old.values[s] for s in common if old.values[s] != 0]
    mx = max((abs(old.values[s] - new.values[s]) for s in common), default=0.0)
    return (statistics.fmean(rel) if rel else None), mx, len(common)


def change_lines(old: Golden | None, new: Golden) -> list[str]:
    """Per metric: signed mean relative change against `old`, max abs diff, steps on one side only."""
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
            tail = (
                f"; steps on one side only: {extra[:10]}{' ...' if len(extra) > 10 else ''}" if extra else ""
            )
            lines.append(
                f"  {m}: mean((old-new)/old) = {mr_s}, max |old-new| = {mx:.6g} over {n} steps{tail}"
            )
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
        raise GoldenFormatError(
            f"{p}: not a writable directory, so {directory} cannot hold the new golden file; nothing was run"
        )


def recalibrate(
    *,
    store: GoldenStore,
    hw: HardwareKey | str,
    suite: str,
    case: str,
    runner: Runner,
    repeats: int,
    only_failing: bool = False,
    checks: Mapping[str, Check | Sequence[Check]] | None = None,
    allow_unknown_hw: bool = False,
    dry_run: bool = False,
    out: Callable[[str], None] = print,
    commit_cwd: str | Path | None = None,
    exact_only: bool = False,
) -> RecalibrationResult:
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
    if exact_only and only_failing:
        raise ValueError("exact_only and only_failing are exclusive")
    try:
        old, old_meta = store.load(key, suite, case)
    except MissingGoldenError:
        if exact_only:
            raise RecalibrationError(
                f"{label}: no reference at {path} to add exact values beside; record it first "
                f"(mhc-harness recalibrate {suite} {case} --hw {key}); nothing was run"
            ) from None
        old, old_meta = None, None

    if not dry_run:
        _require_writable(path.parent)
    runs: list[Golden] = []
    passed: list[bool | None] = []
    prints: list[NumericsFingerprint | None] = []
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
        prints.append(rep.fingerprint)
    fingerprint = _one_fingerprint(prints, label=label)
    if exact_only:
        return _add_exact(
            store=store,
            key=key,
            suite=suite,
            case=case,
            old=old,
            old_meta=old_meta,
            runs=runs,
            fingerprint=fingerprint,
            passed=passed,
            dry_run=dry_run,
            out=out,
            commit_cwd=commit_cwd,
        )
    new, spread = aggregate(runs, label=label)

    if only_failing and old is not None:
        if norm is not None:
            passed = [all(r.ok for r in compare(run, old, norm, source=str(path))) for run in runs]
        if any(p is None for p in passed):
            raise ValueError("only_failing needs checks (or a runner that reports golden_passed)")
        if all(passed):
            out(
                f"[{label}] the current golden file passes all {repeats} repeats: not rewritten (--only-failing)"
            )
            return RecalibrationResult(
                golden=new, spread=spread, changes=(), written=False, path=path, reason="golden still passes"
            )
    changes = change_lines(old, new)
    out(
        f"[{label}] change against {'the old file ' + str(path) if old is not None else 'nothing (new case)'}:"
    )
    for line in changes:
        out(line)
    if fingerprint is not None:
        out(f"[{label}] numerics fingerprint of the runs: {fingerprint.label}")
    dropped = [e.fingerprint_id for e in store.exact_sets(key, suite, case)] if old is not None else []
    if dropped and golden_digest(old) != golden_digest(new):
        out(
            f"[{label}] the exact values of {len(dropped)} other fingerprint(s) were recorded beside the old reference "
            f"and go with it: {', '.join(dropped)} (re-add them there with --exact-only)"
        )
    if dry_run:
        out(f"[{label}] dry run: {path} not written")
        return RecalibrationResult(
            golden=new, spread=spread, changes=tuple(changes), written=False, path=path, reason="dry run"
        )
    meta = build_meta(
        hw=key,
        hw_rule=rule,
        suite=suite,
        case=case,
        golden=new,
        source="mhc-harness recalibrate",
        repeats=repeats,
        spread=spread,
        commit_cwd=commit_cwd,
        numerics=fingerprint,
    )
    store.write(key, suite, case, new, meta)
    out(f"[{label}] wrote {path} and {path.with_suffix('.meta.json').name} (mean of {repeats} repeats)")
    return RecalibrationResult(
        golden=new, spread=spread, changes=tuple(changes), written=True, path=path, reason="written"
    )


def _one_fingerprint(
    prints: Sequence[NumericsFingerprint | None], *, label: str
) -> NumericsFingerprint | None:
    """The repeats' common fingerprint (None when no repeat reported one); an error when they differ."""
    known = [p for p in prints if p is not None]
    if not known:
        return None
    for i, p in enumerate(prints[1:], start=2):
        if p is None or p.id != known[0].id:
            diff = "; ".join(known[0].differences(p)) if p is not None else "repeat reported none"
            raise RecalibrationError(
                f"{label}: repeat {i} ran under another numerics fingerprint than repeat 1 "
                f"({diff}); nothing written"
            )
    return known[0]


def _bitwise_metrics(runs: Sequence[Golden], *, label: str) -> tuple[Golden, list[str]]:
    """The metrics whose every repeat equals repeat 1 bit for bit, and the names of the others."""
    aggregate(runs, label=label)  # same metrics and steps in every repeat, or an error naming them
    same: Golden = {}
    differ: list[str] = []
    for m, s0 in runs[0].items():
        if all(run[m].values == s0.values for run in runs[1:]):
            same[m] = s0
        else:
            step = next(st for st in s0.steps if any(run[m].values[st] != s0.values[st] for run in runs[1:]))
            differ.append(
                f"{m} (first differs at step {step}: {', '.join(repr(run[m].values[step]) for run in runs)})"
            )
    return same, differ


def _add_exact(
    *,
    store: GoldenStore,
    key: str,
    suite: str,
    case: str,
    old: Golden,
    old_meta: dict[str, Any] | None,
    runs: Sequence[Golden],
    fingerprint: NumericsFingerprint | None,
    passed: Sequence[bool | None],
    dry_run: bool,
    out: Callable[[str], None],
    commit_cwd: str | Path | None,
) -> RecalibrationResult:
    label = f"{suite}/{case} on {key}"
    f = store.files(key, suite, case)
    if fingerprint is None:
        raise RecalibrationError(
            f"{label}: the runs reported no numerics fingerprint, so their exact values "
            "cannot be filed under one; nothing written"
        )
    recorded = (old_meta or {}).get("numerics")
    if recorded and recorded["id"] == fingerprint.id:
        raise RecalibrationError(
            f"{label}: this machine's fingerprint {fingerprint.id} recorded the reference "
            f"{f.json}, so its exact values are the reference; to move them, recalibrate "
            "without --exact-only. Nothing written"
        )
    values, differ = _bitwise_metrics(runs, label=label)
    if not values:
        raise RecalibrationError(
            f"{label}: no metric is bitwise reproducible over {len(runs)} repeats here "
            f"({'; '.join(differ)}); nothing written"
        )
    target = f.exact_json(fingerprint.id)
    out(f"[{label}] exact values for this fingerprint: {fingerprint.label}")
    if recorded:
        out(f"  the reference was recorded on {recorded['label']}")
    if differ:
        out(f"  left out, not bitwise reproducible over {len(runs)} repeats: {'; '.join(differ)}")
    existing = {e.fingerprint_id: e for e in store.exact_sets(key, suite, case)}.get(fingerprint.id)
    previous = (
        existing.golden if existing is not None and existing.reference_sha256 == golden_digest(old) else None
    )
    changes = change_lines(previous, values)
    out(
        f"[{label}] change against {'the existing exact set ' + str(target) if previous else 'nothing (new exact set)'}:"
    )
    for line in changes:
        out(line)
    if any(p is False for p in passed):
        out(
            f"[{label}] note: these values miss the reference's approximate lane, which still decides the case "
            "here; the exact values do not make it pass"
        )
    if dry_run:
        out(f"[{label}] dry run: {target} not written")
        return RecalibrationResult(
            golden=values, spread={}, changes=tuple(changes), written=False, path=target, reason="dry run"
        )
    meta = {
        "hardware": key,
        "suite": suite,
        "case": case,
        "date": utc_now(),
        "source": "mhc-harness recalibrate --exact-only",
        "repeats": len(runs),
        "versions": package_versions(),
        "git_commit": git_commit(commit_cwd),
        "numerics": numerics_entry(fingerprint),
        "reference_sha256": golden_digest(old),
    }
    store.write_exact(key, suite, case, values, meta)
    out(
        f"[{label}] wrote {target} (+ .meta.json); the reference {f.json.name} and the other fingerprints' sets "
        "are unchanged"
    )
    return RecalibrationResult(
        golden=values,
        spread={},
        changes=tuple(changes),
        written=True,
        path=target,
        reason="exact set written",
    )
