"""Per-case result files: what a test run leaves in `--mhc-results-dir` for `run` and `recalibrate`.

For every case handed to the fixture, `<dir>/<suite>/<case>.json` holds the actual values in
golden schema (only when they are finite) and `<dir>/<suite>/<case>.result.json` the outcome:
status, hardware key, golden path, message and every check result.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.golden.compare import CheckResult
from harness.golden.errors import GoldenFormatError
from harness.golden.schema import Golden, dumps_golden, load_golden, parse_json

__all__ = ["CaseOutcome", "OutcomeStatus", "load_actual", "read_outcomes", "write_outcome"]

OutcomeStatus = Literal["pass", "fail", "error", "written", "recorded"]


@dataclass(frozen=True, kw_only=True)
class CaseOutcome:
    """What happened to one case: compared, rewritten, recorded or errored."""

    suite: str
    case: str
    hw: str
    status: OutcomeStatus
    """pass / fail (golden mismatch) / error (bad input) / written (--update-golden=all) / recorded."""
    message: str = ""
    golden_path: str | None = None
    nodeid: str | None = None
    rewritten: bool = False
    """True when --update-golden rewrote the golden file."""
    golden_passed: bool | None = None
    """Record-only mode: whether the values passed the existing golden file (None: not compared)."""
    checks: tuple[CheckResult, ...] = field(default_factory=tuple)
    lane: str | None = None
    """The lane that decided: `exact`, `approximate` or `timing` (None: nothing was compared)."""
    lane_reason: str = ""
    """Whether the exact lane applied here and why (`exact: n/a, recorded on ...; this machine ...`)."""
    fingerprint: dict[str, Any] | None = None
    """The numerics fingerprint of the run that produced the values (`NumericsFingerprint.to_json`)."""

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "error")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checks"] = [dataclasses.asdict(c) for c in self.checks]
        return d

    @classmethod
    def from_json(cls, doc: dict[str, Any], *, source: str) -> CaseOutcome:
        try:
            checks = tuple(CheckResult(**c) for c in doc.get("checks", ()))
            return cls(**{k: v for k, v in doc.items() if k != "checks"}, checks=checks)
        except TypeError as exc:
            raise GoldenFormatError(f"{source}: not a case result file ({exc})") from None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_outcome(results_dir: str | Path, outcome: CaseOutcome, actual: Golden | None) -> Path:
    """Write the outcome (and the actual values, when given) of one case; returns the result path."""
    d = Path(results_dir) / outcome.suite
    d.mkdir(parents=True, exist_ok=True)
    if actual is not None:
        _atomic_write(
            d / f"{outcome.case}.json", dumps_golden(actual, target=str(d / f"{outcome.case}.json"))
        )
    path = d / f"{outcome.case}.result.json"
    _atomic_write(path, json.dumps(outcome.to_json(), indent=2, allow_nan=True) + "\n")
    return path


def read_outcomes(results_dir: str | Path, suites: Sequence[str] | None = None) -> list[CaseOutcome]:
    """Every case outcome under `results_dir` (optionally only these suites), sorted by suite, case."""
    root = Path(results_dir)
    out = []
    for p in sorted(root.glob("*/*.result.json")):
        if suites is not None and p.parent.name not in suites:
            continue
        out.append(
            CaseOutcome.from_json(parse_json(p.read_text(encoding="utf-8"), source=str(p)), source=str(p))
        )
    return out


def load_actual(results_dir: str | Path, suite: str, case: str) -> Golden | None:
    """The actual values a run recorded for a case (None when it recorded none)."""
    p = Path(results_dir) / suite / f"{case}.json"
    return load_golden(p) if p.is_file() else None
