"""What the `golden_metrics` fixture does with one case, as a plain function.

`check_case` normalises the metrics a test hands over, compares them with the golden file
of this hardware key (or rewrites / records them, by mode), writes the outcome to the results
directory, and returns a `CaseOutcome`. It never raises for a golden
mismatch or bad golden input: those become `fail` / `error` outcomes whose message the
plugin reports. Nothing is written to the golden store on the way to an error.

Lanes. Approximate and timing checks compare with the case's reference values. An exact check
compares with the exact values of the run's numerics fingerprint (`resolve_exact_lane`): the
reference itself where that fingerprint recorded it, else the fingerprint's exact set. Where the
fingerprint has none, the exact check is `n/a` (it says on which fingerprint the values were
recorded, and this run's), and the approximate lane decides; a metric that only an `n/a` exact
check would decide fails, since no lane decides it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.golden.compare import (
    ApproximateCheck,
    Check,
    CheckResult,
    ExactCheck,
    TimingCheck,
    compare_metric,
    format_results,
)
from harness.golden.errors import GoldenError, MissingGoldenError
from harness.golden.fingerprint import NumericsFingerprint, current_fingerprint
from harness.golden.hardware import HardwareKey
from harness.golden.results import CaseOutcome, write_outcome
from harness.golden.schema import Golden, check_finite, golden_digest, to_golden
from harness.golden.store import GoldenStore, build_meta, recalibrate_command, validate_name

__all__ = [
    "ExactLane",
    "GoldenSettings",
    "check_case",
    "compare_lanes",
    "decided_by",
    "normalize_checks",
    "resolve_exact_lane",
]

UpdateMode = Literal["failed", "all"]


@dataclass(frozen=True, kw_only=True)
class GoldenSettings:
    """Session-wide settings, from the pytest options."""

    golden_dir: Path
    hw: HardwareKey
    update: UpdateMode | None = None
    """`failed`: rewrite failing golden files and still fail; `all`: rewrite all and pass."""
    results_dir: Path | None = None
    record_only: bool = False
    """Recalibration mode: record actual values, compare only to report, never fail on golden."""
    commit_cwd: Path | None = None

    def __post_init__(self) -> None:
        if self.update not in (None, "failed", "all"):
            raise ValueError(f"update={self.update!r} must be None, 'failed' or 'all'")
        if self.update and self.record_only:
            raise ValueError("update and record_only are exclusive")


def normalize_checks(checks: Mapping[str, Check | Sequence[Check]]) -> dict[str, tuple[Check, ...]]:
    """`{metric: check or checks}` -> `{metric: (checks...)}`; `ValueError` naming a bad entry."""
    if not isinstance(checks, Mapping) or not checks:
        raise ValueError("checks must be a non-empty mapping metric -> check or tuple of checks")
    out: dict[str, tuple[Check, ...]] = {}
    for metric, chk in checks.items():
        seq = tuple(chk) if isinstance(chk, Sequence) else (chk,)
        if not seq:
            raise ValueError(f"checks[{metric!r}] is empty")
        for c in seq:
            if not isinstance(c, ExactCheck | ApproximateCheck | TimingCheck):
                raise ValueError(
                    f"checks[{metric!r}]={c!r} is not an ExactCheck, ApproximateCheck or TimingCheck"
                )
        out[metric] = seq
    return out


@dataclass(frozen=True, kw_only=True)
class ExactLane:
    """The exact values that apply to one run, or why none do."""

    golden: Golden | None
    """Exact values of the run's fingerprint; None: the exact lane is n/a here."""
    reason: str
    """`exact: enforced, ...` or `exact: n/a, recorded on <fingerprint>; this machine <fingerprint>`."""


def resolve_exact_lane(
    store: GoldenStore,
    hw: str,
    suite: str,
    case: str,
    reference: Golden,
    meta: Mapping[str, Any] | None,
    fingerprint: NumericsFingerprint,
) -> ExactLane:
    """Which exact values this run's `fingerprint` is held to (see the module docstring)."""
    recorded = (meta or {}).get("numerics")
    if recorded and recorded["id"] == fingerprint.id:
        return ExactLane(
            golden=reference,
            reason=f"exact: enforced, this fingerprint recorded the reference ({fingerprint.label})",
        )
    sets = {e.fingerprint_id: e for e in store.exact_sets(hw, suite, case)}
    own = sets.get(fingerprint.id)
    if own is not None and own.reference_sha256 == golden_digest(reference):
        return ExactLane(
            golden=own.golden,
            reason=f"exact: enforced, exact values of this fingerprint added "
            f"{own.meta['date']} ({fingerprint.label})",
        )
    where = (
        recorded["label"]
        if recorded
        else "an unrecorded fingerprint (the meta predates fingerprints; recalibrate to record one)"
    )
    others = sorted(i for i in sets if i != fingerprint.id)
    also = f"; exact values also for {', '.join(others)}" if others else ""
    stale = "; this fingerprint's exact set was recorded beside another reference" if own is not None else ""
    return ExactLane(
        golden=None, reason=f"exact: n/a, recorded on {where}{also}{stale}; this machine {fingerprint.label}"
    )


def compare_lanes(
    actual: Golden,
    reference: Golden,
    lane: ExactLane,
    checks: Mapping[str, tuple[Check, ...]],
    *,
    source: str,
) -> tuple[CheckResult, ...]:
    """Every check of every metric: exact ones against `lane` (`n/a` without exact values), the
    others against `reference`; a metric whose every check is `n/a` gets a failing result."""
    out: list[CheckResult] = []
    for metric, seq in checks.items():
        mine = []
        for c in seq:
            if isinstance(c, ExactCheck) and lane.golden is None:
                mine.append(
                    CheckResult(
                        metric=metric,
                        check=c.describe(),
                        status="n/a",
                        message=f"{metric} [exact]: {lane.reason}",
                    )
                )
            else:
                golden = lane.golden if isinstance(c, ExactCheck) else reference
                assert golden is not None  # an exact check without a lane's values went to "n/a" above
                mine.append(compare_metric(metric, actual.get(metric), golden.get(metric), c, source=source))
        if all(r.status == "n/a" for r in mine):
            mine.append(
                CheckResult(
                    metric=metric,
                    check="lanes",
                    status="fail",
                    message=f"{metric}: no lane decides: its only check is exact, n/a on this "
                    f"machine ({lane.reason}); give it an approximate band (rtol / atol)",
                )
            )
        out += mine
    return tuple(out)


def decided_by(checks: Mapping[str, tuple[Check, ...]], lane: ExactLane | None) -> str:
    """`exact`, `approximate` or `timing`: the strictest lane that decided the case."""
    kinds = {type(c) for seq in checks.values() for c in seq}
    if ExactCheck in kinds and lane is not None and lane.golden is not None:
        return "exact"
    return "approximate" if ApproximateCheck in kinds or ExactCheck in kinds else "timing"


def _write(
    settings: GoldenSettings,
    store: GoldenStore,
    suite: str,
    case: str,
    actual: Golden,
    source: str,
    fingerprint: NumericsFingerprint,
) -> Path:
    meta = build_meta(
        hw=settings.hw.key,
        hw_rule=settings.hw.rule,
        suite=suite,
        case=case,
        golden=actual,
        source=source,
        repeats=1,
        commit_cwd=settings.commit_cwd,
        numerics=fingerprint,
    )
    return store.write(settings.hw.key, suite, case, actual, meta).json


def _finish(settings: GoldenSettings, outcome: CaseOutcome, actual: Golden | None) -> CaseOutcome:
    if settings.results_dir is not None:
        write_outcome(settings.results_dir, outcome, actual)
    return outcome


def check_case(
    settings: GoldenSettings,
    *,
    suite: str,
    case: str,
    metrics: Mapping[str, Any],
    checks: Mapping[str, Check | Sequence[Check]],
    nodeid: str | None = None,
    fingerprint: NumericsFingerprint | None = None,
) -> CaseOutcome:
    """Compare, rewrite or record one case according to `settings`; see the module docstring.
    `fingerprint`: the numerics fingerprint of the process that produced `metrics` (default:
    this process's)."""
    validate_name(suite, field="suite")
    validate_name(case, field="case")
    norm = normalize_checks(checks)
    fingerprint = fingerprint or current_fingerprint()
    hw = settings.hw.key
    store = GoldenStore(settings.golden_dir)
    path = store.files(hw, suite, case).json
    base = dict(
        suite=suite, case=case, hw=hw, nodeid=nodeid, golden_path=str(path), fingerprint=fingerprint.to_json()
    )
    label = f"{suite}/{case} on {hw}"
    try:
        actual = to_golden(metrics, source=f"actual metrics of {label}")
        check_finite(actual, source=f"actual metrics of {label}")
    except GoldenError as exc:
        return _finish(settings, CaseOutcome(**base, status="error", message=str(exc)), None)

    if settings.update == "all":
        _write(settings, store, suite, case, actual, "pytest --update-golden=all", fingerprint)
        return _finish(
            settings,
            CaseOutcome(
                **base, status="written", rewritten=True, message=f"wrote {path} (--update-golden=all)"
            ),
            actual,
        )
    try:
        golden, _meta = store.load(hw, suite, case)
    except MissingGoldenError as exc:
        if settings.record_only:
            return _finish(settings, CaseOutcome(**base, status="recorded", message=str(exc)), actual)
        if settings.update == "failed":
            _write(settings, store, suite, case, actual, "pytest --update-golden=failed", fingerprint)
            return _finish(
                settings,
                CaseOutcome(
                    **base,
                    status="fail",
                    rewritten=True,
                    message=f"{exc}\nwrote {path} (--update-golden=failed); rerun to confirm",
                ),
                actual,
            )
        return _finish(settings, CaseOutcome(**base, status="error", message=str(exc)), actual)
    except GoldenError as exc:
        status = "recorded" if settings.record_only else "error"
        return _finish(settings, CaseOutcome(**base, status=status, message=str(exc)), actual)

    try:
        lane = resolve_exact_lane(store, hw, suite, case, golden, _meta, fingerprint)
    except GoldenError as exc:
        status = "recorded" if settings.record_only else "error"
        return _finish(settings, CaseOutcome(**base, status=status, message=str(exc)), actual)
    results = compare_lanes(actual, golden, lane, norm, source=str(path))
    passed = all(r.ok for r in results)
    base.update(lane=decided_by(norm, lane), lane_reason=lane.reason)
    if settings.record_only:
        return _finish(
            settings,
            CaseOutcome(
                **base,
                status="recorded",
                golden_passed=passed,
                checks=results,
                message=format_results(results),
            ),
            actual,
        )
    if passed:
        return _finish(settings, CaseOutcome(**base, status="pass", checks=results), actual)
    lines = [f"golden mismatch for {label} (golden file {path}; {lane.reason}):", format_results(results)]
    if any(r.status == "refresh" for r in results):
        lines.append(f"refresh with: {recalibrate_command(suite, case, hw)}")
    rewritten = False
    if settings.update == "failed":
        _write(settings, store, suite, case, actual, "pytest --update-golden=failed", fingerprint)
        rewritten = True
        lines.append(f"rewrote {path} (--update-golden=failed); the test still fails, rerun to confirm")
    return _finish(
        settings,
        CaseOutcome(**base, status="fail", rewritten=rewritten, checks=results, message="\n".join(lines)),
        actual,
    )
