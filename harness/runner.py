"""Run suites through pytest in subprocesses and collect what they left behind.

`run_suites` backs `mhc-harness run`: one `python -m pytest suites/<suite>` per suite with
`--junitxml`, `--mhc-results-dir` and `--mhc-progress-file` (the perf suite with `-p no:xdist`
and `--benchmark-json`, ready for `perf-history append`), plus that suite's own arguments
(`suite_args`, e.g. xdist workers). The plugin does the golden comparisons during the run; the
subprocess's output goes to `<out>/pytest-<suite>.log` while a progress line per suite is printed
(`harness.progress`); this module then gathers JUnit counts and case outcomes.
`pytest_case_runner` backs `mhc-harness recalibrate`: it runs one case in record-only mode.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from harness.golden.errors import RecalibrationError
from harness.golden.fingerprint import fingerprint_from_json
from harness.golden.recalibrate import Repeat
from harness.golden.results import CaseOutcome, load_actual, read_outcomes
from harness.progress import ProgressPrinter

__all__ = [
    "NO_XDIST_SUITES",
    "RunSummary",
    "SuiteRun",
    "available_suites",
    "check_suites",
    "pytest_case_runner",
    "run_suites",
]

NO_XDIST_SUITES = frozenset({"perf"})
"""Suites run with `-p no:xdist` (benchmarks never run under xdist)."""


def available_suites(suites_dir: str | Path) -> list[str]:
    """Directories under `suites_dir` (not starting with `_` or `.`), sorted."""
    d = Path(suites_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def check_suites(suites: Sequence[str], suites_dir: str | Path) -> list[str]:
    """Return `suites` (all when empty) or raise `ValueError` listing the valid names."""
    valid = available_suites(suites_dir)
    unknown = [s for s in suites if s not in valid]
    if not Path(suites_dir).is_dir():
        raise ValueError(
            f"no suites directory {suites_dir} here ({Path.cwd()}): `mhc-harness run` and `recalibrate` "
            "run the suites of a checkout of mhc-suite; run them from its root or pass --suites-dir "
            "(`mhc-harness conformance` needs no checkout)"
        )
    if unknown:
        raise ValueError(
            f"unknown suite(s) {unknown} in {suites_dir}; valid suites: {', '.join(valid) or '(none)'}"
        )
    return list(suites) or valid


@dataclass(frozen=True, kw_only=True)
class SuiteRun:
    """One pytest subprocess for one suite."""

    suite: str
    command: tuple[str, ...]
    returncode: int
    junit: Path
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    output_tail: str = ""

    @property
    def ok(self) -> bool:
        """pytest exit 0 (an empty suite, exit 5, fails unless the suite's conftest maps it to 0)."""
        return self.returncode == 0


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Everything `mhc-harness run` reports on."""

    runs: tuple[SuiteRun, ...]
    cases: tuple[CaseOutcome, ...]
    results_dir: Path
    golden_dir: Path
    hw: str | None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs) and not any(c.failed for c in self.cases)


def _junit_counts(path: Path) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not path.is_file():
        return counts
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return counts
    for suite in root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    return counts


def _common_args(*, golden_dir: Path | None, hw: str | None) -> list[str]:
    args = ["-p", "no:cacheprovider"]
    if golden_dir is not None:
        args.append(f"--golden-dir={golden_dir}")
    if hw:
        args.append(f"--hw={hw}")
    return args


def _run_logged(
    cmd: Sequence[str], *, cwd: Path, log: Path, timeout_s: float | None, poll: Callable[[], None]
) -> int:
    """Run `cmd` with its output in `log`, calling `poll` every second; at `timeout_s` its whole
    process group is killed and 124 returned."""
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                try:
                    return proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    poll()
                if deadline is not None and time.monotonic() > deadline:
                    with suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    f.write(f"\ntimed out after {timeout_s} s\n")
                    return 124
        except BaseException:  # interrupted: take pytest and its workers down with us
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def run_suites(
    suites: Sequence[str],
    *,
    suites_dir: str | Path,
    out_dir: str | Path,
    golden_dir: str | Path,
    hw: str | None = None,
    pytest_args: str | Sequence[str] = (),
    python: str = sys.executable,
    timeout_s: float | None = None,
    suite_args: Mapping[str, Sequence[str]] | None = None,
    out: Callable[[str], None] = print,
    progress_every_s: float = 10.0,
) -> RunSummary:
    """Run each suite through pytest; return the JUnit counts and the per-case outcomes. `suite_args`
    adds arguments to one suite's command (`{"unit": ["-n", "2"]}`); `out` gets the progress lines."""
    suites_dir, out_dir, golden_dir = (
        Path(suites_dir).resolve(),
        Path(out_dir).resolve(),
        Path(golden_dir).resolve(),
    )
    names = check_suites(suites, suites_dir)
    unknown = sorted(set(suite_args or {}) - set(names))
    if unknown:
        raise ValueError(
            f"suite arguments for {unknown}, which this run does not run (it runs {', '.join(names)})"
        )
    extra = shlex.split(pytest_args) if isinstance(pytest_args, str) else list(pytest_args)
    results_dir = out_dir / "cases"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for suite in names:
        junit = out_dir / f"junit-{suite}.xml"
        progress = out_dir / f".progress-{suite}.json"
        log = out_dir / f"pytest-{suite}.log"
        shutil.rmtree(results_dir / suite, ignore_errors=True)  # no stale outcomes from an earlier run
        junit.unlink(missing_ok=True)
        progress.unlink(missing_ok=True)
        cmd = [
            python,
            "-m",
            "pytest",
            str(suites_dir / suite),
            f"--junitxml={junit}",
            f"--mhc-results-dir={results_dir}",
            f"--mhc-progress-file={progress}",
            *_common_args(golden_dir=golden_dir, hw=hw),
        ]
        if suite in NO_XDIST_SUITES:
            cmd += ["-p", "no:xdist"]
            if importlib.util.find_spec("pytest_benchmark") is not None:
                cmd.append(f"--benchmark-json={out_dir / f'benchmark-{suite}.json'}")
        cmd += [*(suite_args or {}).get(suite, ()), *extra]
        out(f"$ {shlex.join(cmd)}")
        printer = ProgressPrinter(suite, progress, out=out, every_s=progress_every_s)
        rc = _run_logged(cmd, cwd=suites_dir.parent, log=log, timeout_s=timeout_s, poll=printer.poll)
        printer.poll(final=True)
        progress.unlink(missing_ok=True)
        output = log.read_text(encoding="utf-8", errors="replace")
        runs.append(
            SuiteRun(
                suite=suite,
                command=tuple(cmd),
                returncode=rc,
                junit=junit,
                output_tail=output[-4000:],
                **_junit_counts(junit),
            )
        )
    return RunSummary(
        runs=tuple(runs),
        cases=tuple(read_outcomes(results_dir, names)),
        results_dir=results_dir,
        golden_dir=golden_dir,
        hw=hw,
    )


def pytest_case_runner(
    suite: str,
    case: str,
    *,
    suites_dir: str | Path,
    golden_dir: str | Path,
    hw: str,
    pytest_args: Sequence[str] = (),
    python: str = sys.executable,
    timeout_s: float | None = None,
):
    """A recalibration runner: each call runs `suites/<suite>` in record-only mode for `case`."""
    suites_dir, golden_dir = Path(suites_dir).resolve(), Path(golden_dir).resolve()
    check_suites([suite], suites_dir)

    def run(i: int) -> Repeat:
        with tempfile.TemporaryDirectory(prefix="mhc-recal-") as tmp:
            cmd = [
                python,
                "-m",
                "pytest",
                str(suites_dir / suite),
                "-q",
                f"--mhc-results-dir={tmp}",
                "--mhc-record-only",
                f"--mhc-case={case}",
                *_common_args(golden_dir=golden_dir, hw=hw),
            ]
            if suite in NO_XDIST_SUITES:
                cmd += ["-p", "no:xdist"]
            cmd += list(pytest_args)
            try:
                proc = subprocess.run(
                    cmd, cwd=suites_dir.parent, capture_output=True, text=True, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired:
                raise RecalibrationError(
                    f"repeat {i + 1}: {shlex.join(cmd)} timed out after {timeout_s} s; nothing written"
                ) from None
            tail = (proc.stdout + proc.stderr)[-3000:]
            if proc.returncode == 5:  # pytest: nothing collected, or everything deselected
                raise RecalibrationError(
                    f"repeat {i + 1}: no test in {suites_dir / suite} runs case {case!r} "
                    f"(pytest exit 5: nothing collected or all deselected); nothing written.\n"
                    f"$ {shlex.join(cmd)}\n{tail}"
                )
            if proc.returncode != 0:
                raise RecalibrationError(
                    f"repeat {i + 1}: the run failed (pytest exit {proc.returncode}); nothing "
                    f"written.\n$ {shlex.join(cmd)}\n{tail}"
                )
            outcome = next((o for o in read_outcomes(tmp, [suite]) if o.case == case), None)
            if outcome is None:
                raise RecalibrationError(
                    f"repeat {i + 1}: no test in {suites_dir / suite} handed case {case!r} to "
                    f"golden_metrics; nothing written.\n{tail}"
                )
            actual = load_actual(tmp, suite, case)
            if outcome.status == "error" or actual is None:
                raise RecalibrationError(f"repeat {i + 1}: {outcome.message}; nothing written")
            fingerprint = (
                None
                if outcome.fingerprint is None
                else fingerprint_from_json(outcome.fingerprint, source=f"{suite}/{case} repeat {i + 1}")
            )
            return Repeat(metrics=actual, golden_passed=outcome.golden_passed, fingerprint=fingerprint)

    return run
