"""What the ``golden_metrics`` fixture does with one case, as a plain function.

:func:`check_case` normalises the metrics a test hands over, compares them with the golden file
of this hardware key (or rewrites / records them, by mode), writes the outcome to the results
directory, and returns a :class:`~harness.results.CaseOutcome`. It never raises for a golden
mismatch or bad golden input: those become ``fail`` / ``error`` outcomes whose message the
plugin reports. Nothing is written to the golden store on the way to an error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.compare import ApproximateCheck, Check, ExactCheck, TimingCheck, compare, format_results
from harness.errors import GoldenError, MissingGoldenError
from harness.hardware import HardwareKey
from harness.results import CaseOutcome, write_outcome
from harness.schema import Golden, check_finite, to_golden
from harness.store import GoldenStore, build_meta, recalibrate_command, validate_name

__all__ = ["GoldenSettings", "check_case", "normalize_checks"]

UpdateMode = Literal["failed", "all"]


@dataclass(frozen=True, kw_only=True)
class GoldenSettings:
    """Session-wide settings, from the pytest options."""

    golden_dir: Path
    hw: HardwareKey
    update: UpdateMode | None = None
    """``failed``: rewrite failing golden files and still fail; ``all``: rewrite all and pass."""
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
    """``{metric: check or checks}`` -> ``{metric: (checks...)}``; ``ValueError`` naming a bad entry."""
    if not isinstance(checks, Mapping) or not checks:
        raise ValueError("checks must be a non-empty mapping metric -> check or tuple of checks")
    out: dict[str, tuple[Check, ...]] = {}
    for metric, chk in checks.items():
        seq = tuple(chk) if isinstance(chk, Sequence) else (chk,)
        if not seq:
            raise ValueError(f"checks[{metric!r}] is empty")
        for c in seq:
            if not isinstance(c, ExactCheck | ApproximateCheck | TimingCheck):
                raise ValueError(f"checks[{metric!r}]={c!r} is not an ExactCheck, ApproximateCheck or TimingCheck")
        out[metric] = seq
    return out


def _write(settings: GoldenSettings, store: GoldenStore, suite: str, case: str, actual: Golden, source: str) -> Path:
    meta = build_meta(hw=settings.hw.key, hw_rule=settings.hw.rule, suite=suite, case=case, golden=actual,
                      source=source, repeats=1, commit_cwd=settings.commit_cwd)
    return store.write(settings.hw.key, suite, case, actual, meta).json


def _finish(settings: GoldenSettings, outcome: CaseOutcome, actual: Golden | None) -> CaseOutcome:
    if settings.results_dir is not None:
        write_outcome(settings.results_dir, outcome, actual)
    return outcome


def check_case(settings: GoldenSettings, *, suite: str, case: str, metrics: Mapping[str, Any],
               checks: Mapping[str, Check | Sequence[Check]], nodeid: str | None = None) -> CaseOutcome:
    """Compare, rewrite or record one case according to ``settings``; see the module docstring."""
    validate_name(suite, field="suite")
    validate_name(case, field="case")
    norm = normalize_checks(checks)
    hw = settings.hw.key
    store = GoldenStore(settings.golden_dir)
    path = store.files(hw, suite, case).json
    base = dict(suite=suite, case=case, hw=hw, nodeid=nodeid, golden_path=str(path))
    label = f"{suite}/{case} on {hw}"
    try:
        actual = to_golden(metrics, source=f"actual metrics of {label}")
        check_finite(actual, source=f"actual metrics of {label}")
    except GoldenError as exc:
        return _finish(settings, CaseOutcome(**base, status="error", message=str(exc)), None)

    if settings.update == "all":
        _write(settings, store, suite, case, actual, "pytest --update-golden=all")
        return _finish(settings, CaseOutcome(**base, status="written", rewritten=True,
                                             message=f"wrote {path} (--update-golden=all)"), actual)
    try:
        golden, _meta = store.load(hw, suite, case)
    except MissingGoldenError as exc:
        if settings.record_only:
            return _finish(settings, CaseOutcome(**base, status="recorded", message=str(exc)), actual)
        if settings.update == "failed":
            _write(settings, store, suite, case, actual, "pytest --update-golden=failed")
            return _finish(settings, CaseOutcome(**base, status="fail", rewritten=True,
                                                 message=f"{exc}\nwrote {path} (--update-golden=failed); rerun to confirm"),
                           actual)
        return _finish(settings, CaseOutcome(**base, status="error", message=str(exc)), actual)
    except GoldenError as exc:
        status = "recorded" if settings.record_only else "error"
        return _finish(settings, CaseOutcome(**base, status=status, message=str(exc)), actual)

    results = compare(actual, golden, norm, source=str(path))
    passed = all(r.ok for r in results)
    if settings.record_only:
        return _finish(settings, CaseOutcome(**base, status="recorded", golden_passed=passed, checks=results,
                                             message=format_results(results)), actual)
    if passed:
        return _finish(settings, CaseOutcome(**base, status="pass", checks=results), actual)
    lines = [f"golden mismatch for {label} (golden file {path}):", format_results(results)]
    if any(r.status == "refresh" for r in results):
        lines.append(f"refresh with: {recalibrate_command(suite, case, hw)}")
    rewritten = False
    if settings.update == "failed":
        _write(settings, store, suite, case, actual, "pytest --update-golden=failed")
        rewritten = True
        lines.append(f"rewrote {path} (--update-golden=failed); the test still fails, rerun to confirm")
    return _finish(settings, CaseOutcome(**base, status="fail", rewritten=rewritten, checks=results,
                                         message="\n".join(lines)), actual)
