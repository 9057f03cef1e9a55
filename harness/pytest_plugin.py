"""pytest plugin (entry point `pytest11`): golden options, the `golden_case` marker and the
`golden_metrics` fixture. Thin on purpose: the logic lives in `harness.golden.case_check`.

Usage in a suite::

    from harness import ExactCheck, ApproximateCheck

    @pytest.mark.golden_case("gpt_tp1_pp1_mhc")        # optional: lets recalibration select it
    def test_gpt_mhc(golden_metrics):
        losses = train(...)                             # [50] per-step losses
        golden_metrics.check("gpt_tp1_pp1_mhc", {"lm loss": losses},
                             {"lm loss": (ExactCheck(), ApproximateCheck(rtol=0.05))})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.golden.case_check import GoldenSettings
    from harness.golden.compare import Check
    from harness.golden.fingerprint import NumericsFingerprint
    from harness.golden.results import CaseOutcome
    from harness.progress import ProgressWriter

__all__ = ["GoldenMetrics", "suite_from_path"]

_SETTINGS = pytest.StashKey["GoldenSettings"]()
_SEEN = pytest.StashKey[dict[tuple[str, str], str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("mhc-golden", "mHC golden values (harness)")
    g.addoption("--hw", default=None, help="hardware key (overrides $MHC_HW and detection), e.g. dgx_h100")
    g.addoption("--golden-dir", default=None, help="golden store root (default: <rootdir>/golden)")
    g.addoption(
        "--update-golden",
        choices=("failed", "all"),
        default=None,
        help="failed: rewrite failing golden files and still fail; all: rewrite every file and pass",
    )
    g.addoption(
        "--mhc-results-dir",
        default=None,
        help="write each case's actual values and outcome under this directory",
    )
    g.addoption(
        "--mhc-record-only",
        action="store_true",
        default=False,
        help="record actual values without failing on golden values (used by recalibrate)",
    )
    g.addoption(
        "--mhc-case",
        action="append",
        default=[],
        metavar="CASE",
        help="run only tests that may hand this case to golden_metrics (repeatable)",
    )
    g.addoption(
        "--mhc-progress-file",
        default=None,
        metavar="PATH",
        help="keep the run's progress (tests done / total, failures) in this JSON file (mhc-harness run)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "golden_case(*names): the golden case names a test hands to golden_metrics "
        "(lets --mhc-case select it without running the others)",
    )
    if config.getoption("update_golden") and config.getoption("mhc_record_only"):
        raise pytest.UsageError("--update-golden and --mhc-record-only are exclusive")
    path = config.getoption("mhc_progress_file")
    if path and not hasattr(config, "workerinput"):  # under xdist, the controller counts the workers' reports
        from harness.progress import ProgressWriter

        config.pluginmanager.register(
            _ProgressHooks(ProgressWriter(Path(config.invocation_params.dir, path))), "mhc-progress"
        )


class _ProgressHooks:
    """The hooks behind `--mhc-progress-file` (registered only when it is given)."""

    def __init__(self, writer: ProgressWriter) -> None:
        self.writer = writer

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:
            self.writer.collected(len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Sequence[str]) -> None:
        self.writer.collected(len(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.writer.report(report.nodeid, report.when, report.outcome)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.writer.finish()


def _uses_fixture(item: pytest.Item) -> bool:
    return "golden_metrics" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("mhc_case"))
    if not wanted:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        names = {n for m in item.iter_markers("golden_case") for n in m.args}
        (keep if _uses_fixture(item) and (not names or names & wanted) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def suite_from_path(path: Path) -> str | None:
    """The suite of a test file: the directory right after the last `suites` in its path."""
    parts = Path(path).parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "suites":
            return parts[i + 1]
    return None


def _settings(config: pytest.Config) -> GoldenSettings:
    if _SETTINGS not in config.stash:
        from harness.golden.case_check import GoldenSettings
        from harness.golden.hardware import detect_hardware

        def _path(opt: str) -> Path | None:
            v = config.getoption(opt)
            return None if v is None else Path(config.invocation_params.dir, v).resolve()

        config.stash[_SETTINGS] = GoldenSettings(
            golden_dir=_path("golden_dir") or Path(config.rootpath, "golden"),
            hw=detect_hardware(override=config.getoption("hw")),
            update=config.getoption("update_golden"),
            results_dir=_path("mhc_results_dir"),
            record_only=config.getoption("mhc_record_only"),
            commit_cwd=config.rootpath,
        )
    return config.stash[_SETTINGS]


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Add the hardware key and package versions to pytest-benchmark's machine_info (read by perf-history)."""
    from harness.golden.provenance import package_versions

    machine_info["mhc_hw"] = _settings(config).hw.key
    machine_info["mhc_versions"] = package_versions()


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_commit_info(config: pytest.Config, commit_info: dict[str, Any]) -> None:
    """Record `$MHC_GIT_COMMIT` as the benchmark JSON's commit where it is set (a copy of the tree, such as the
    device machine's, has a HEAD of its own); `dirty` then says nothing about that commit and becomes None."""
    from harness.golden.provenance import given_commit

    given = given_commit()
    if given:
        commit_info.update(id=given, dirty=None)


class GoldenMetrics:
    """The `golden_metrics` fixture: hand a case's metrics over with `check`."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request

    @property
    def settings(self) -> GoldenSettings:
        """Golden dir, hardware key and mode of this session."""
        return _settings(self._request.config)

    def check(
        self,
        case: str,
        metrics: Mapping[str, Any],
        checks: Mapping[str, Check | Sequence[Check]],
        *,
        suite: str | None = None,
        fingerprint: NumericsFingerprint | Mapping[str, Any] | None = None,
    ) -> CaseOutcome:
        """Compare `metrics` with `golden/<hw>/<suite>/<case>.json` using `checks`; fail the test on mismatch.

        `metrics`: `{metric: [v_step1, v_step2, ...]}`, `{metric: {step: v}}` or golden schema.
        `checks`: `{metric: check or (checks...)}`; only these metrics are compared, all are stored.
        `suite`: default `suites/<suite>/...` of the test file.
        `fingerprint`: the numerics fingerprint of the process that computed `metrics` (a worker's,
        as `NumericsFingerprint` or its JSON); default: this process's. It decides the exact lane.
        The JUnit entry of the test gets `golden_lane`, `golden_exact` and `numerics_fingerprint`.
        """
        __tracebackhide__ = True
        from harness.golden.case_check import check_case
        from harness.golden.errors import GoldenError
        from harness.golden.fingerprint import fingerprint_from_json

        node = self._request.node
        suite = suite or suite_from_path(node.path)
        if suite is None:
            pytest.fail(
                f"{node.nodeid}: cannot derive the suite from {node.path} (not under suites/<suite>/); "
                "pass suite= to golden_metrics.check",
                pytrace=False,
            )
        declared = {n for m in node.iter_markers("golden_case") for n in m.args}
        if declared and case not in declared:
            pytest.fail(
                f"{node.nodeid}: case {case!r} is not among its golden_case marker names {sorted(declared)}",
                pytrace=False,
            )
        seen = self._request.config.stash.setdefault(_SEEN, {})
        if seen.get((suite, case), node.nodeid) != node.nodeid:
            pytest.fail(
                f"{node.nodeid}: case {suite}/{case} was already checked by {seen[(suite, case)]}; "
                "case names must be unique",
                pytrace=False,
            )
        seen[(suite, case)] = node.nodeid
        try:
            if fingerprint is not None and not hasattr(fingerprint, "id"):
                fingerprint = fingerprint_from_json(fingerprint, source=f"{suite}/{case}: fingerprint")
            outcome = check_case(
                self.settings,
                suite=suite,
                case=case,
                metrics=metrics,
                checks=checks,
                nodeid=node.nodeid,
                fingerprint=fingerprint,
            )
        except (GoldenError, ValueError) as exc:
            pytest.fail(f"{suite}/{case}: {exc}", pytrace=False)
        node.user_properties += [
            ("golden_case", f"{suite}/{case}"),
            ("golden_lane", outcome.lane or "-"),
            ("golden_exact", outcome.lane_reason or "-"),
        ]
        if outcome.fingerprint is not None:
            node.user_properties.append(
                ("numerics_fingerprint", fingerprint_from_json(outcome.fingerprint, source=case).label)
            )
        if outcome.failed:
            pytest.fail(outcome.message, pytrace=False)
        return outcome


@pytest.fixture
def golden_metrics(request: pytest.FixtureRequest) -> GoldenMetrics:
    """Hand a case's per-step metrics to the golden store: `golden_metrics.check(case, metrics, checks)`."""
    return GoldenMetrics(request)


@pytest.fixture
def tree_rows(request: pytest.FixtureRequest):
    """Hand a Megatron-LM tree comparison to report.md: `tree_rows(TreeRow(...))` (`harness.upstream.tree_report`)."""
    from harness.upstream.tree_report import record

    return lambda row: record(_settings(request.config).results_dir, row)


@pytest.fixture(scope="session")
def megatron_lm_tree():
    """The Megatron-LM tree under test (`harness.upstream.megatron_tree.tree_under_test`); skips without one, fails
    naming the path for one that is not a usable tree or does not import here."""
    from harness.upstream.megatron_tree import TreeError, tree_under_test

    try:
        tree = tree_under_test()
    except TreeError as exc:
        pytest.fail(str(exc), pytrace=False)
    if tree is None:
        pytest.skip(
            "no Megatron-LM tree: pass --megatron-lm TREE to mhc-harness run (or set MHC_MEGATRON_LM)"
        )
    return tree
