"""Fixtures of the pipeline-parallel suite: the single-process reference runs."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the pp suite needs megatron-core")

from suites.pp.batches import Batches, Planned  # noqa: E402
from suites.pp.cases import CASES, ROUNDED_HANDOFF, Case  # noqa: E402


class ReferenceRuns:
    """Single-process (PP = TP = 1) runs, with (`"mhc"`) and without (`"no-mhc"`) mHC, with MoE MLPs
    (`"mhc-moe"`), with two MTP depths under dev's numerics (`"mhc-mtp"`), and the hybrid stack `*-*E` (`"mhc-hybrid"`;
    with an MTP depth `*E` under dev's numerics: `"mhc-hybrid-mtp"`); each writes init.pt + rank0.pt. Those the
    session's pipelined cases need run in one launch on the first lookup (`suites.pp.batches`), any other alone."""

    FLAGS = {
        "mhc": [],
        "no-mhc": ["--no-mhc"],
        "mhc-moe": ["--moe", "alltoall"],
        "mhc-mtp": ["--mtp", "2", "--numerics", "dev"],
        "mhc-hybrid": ["--hybrid", "*-*E"],
        "mhc-hybrid-mtp": ["--hybrid", "*-*E/*E", "--numerics", "dev"],
        "mhc-dev-bf16": ["--bf16", "--numerics", "dev"],
        "mhc-hybrid-dev-bf16": ["--hybrid", "*E*E", "--bf16", "--numerics", "dev"],
        "sp": ["--single-pass"],
        "sp-bf16": ["--single-pass", "--bf16"],
        "sp-hybrid": ["--single-pass", "--hybrid", "*E*E"],
        "sp-hybrid-bf16": ["--single-pass", "--bf16", "--hybrid", "*E*E"],
    }

    def __init__(self, root: Path, *, wanted: Iterable[str] = (), batch: bool = True) -> None:
        self.runs = Batches(root, batch=batch)
        for name in wanted:
            self._plan(name)

    def _plan(self, name: str) -> None:
        self.runs.plan(name, Planned(nproc=1, args=tuple(self.FLAGS[name])))

    def __getitem__(self, name: str) -> Path:
        if name not in self.runs.planned:
            self._plan(name)
        return self.runs[name]


def _selected_cases(session: pytest.Session) -> list[Case]:
    """The pipelined cases this session runs (after -k and other deselection)."""
    cases = [
        item.callspec.params["case"]
        for item in session.items
        if isinstance(item, pytest.Function) and item.originalname in PIPELINED_TESTS
    ]
    return [c for c in cases if isinstance(c, Case)]


PIPELINED_TESTS = ("test_pipelined_run_reproduces_single_process", "test_a_rounded_handoff_moves_a_bf16_run")
"""The tests whose `case` parameter is a pipelined run of `pipelined_runs`."""


def _batching(config: pytest.Config) -> bool:
    """Batches need the session's own selection; an xdist worker holds every item and runs some."""
    return not hasattr(config, "workerinput")


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, request) -> ReferenceRuns:
    """The single-process reference runs (`ReferenceRuns`)."""
    wanted = sorted({c.reference_run for c in _selected_cases(request.session)})
    return ReferenceRuns(
        tmp_path_factory.mktemp("pp-reference"), wanted=wanted, batch=_batching(request.config)
    )


@pytest.fixture(scope="session")
def pipelined_runs(tmp_path_factory, request, reference_runs) -> Batches:
    """The session's pipelined cases by name, each from its reference's initial weights, batched by world size."""
    runs = Batches(
        tmp_path_factory.mktemp("pp-runs"),
        batch=_batching(request.config),
        before=lambda need: reference_runs[need],
    )
    for case in _selected_cases(request.session) if _batching(request.config) else [*CASES, ROUNDED_HANDOFF]:
        init = reference_runs.runs.root / case.reference_run / "init.pt"
        runs.plan(
            case.name,
            Planned(nproc=case.nproc, args=(*case.args, "--init", str(init)), needs=(case.reference_run,)),
        )
    return runs


class TreeReport:
    """Per case, the worst differences of the tree's run against its single process and against ours,
    printed at the end of the session (and so in the harness's pytest-pp.log)."""

    def __init__(self) -> None:
        self.label: str | None = None
        self.rows: list[tuple[str, dict[str, float] | None, dict[str, float]]] = []

    def add(self, case: str, vs_single: dict[str, float] | None, vs_ours: dict[str, float]) -> None:
        self.rows.append((case, vs_single, vs_ours))

    def lines(self) -> list[str]:
        def fmt(d: dict[str, float] | None) -> str:
            return "-" if d is None else " / ".join(f"{d[k]:.1e}" for k in ("loss", "grad", "weight"))

        out = [
            f"Megatron-LM tree {self.label}: worst relative difference, loss / grad / weight",
            f"{'case':<28} {'tree vs its single process':<30} tree vs ours",
        ]
        out += [f"{case:<28} {fmt(a):<30} {fmt(b)}" for case, a, b in self.rows]
        return out


_TREE_REPORT = TreeReport()


@pytest.fixture(scope="session")
def tree_report() -> TreeReport:
    """The session's tree table (`TreeReport`)."""
    return _TREE_REPORT


def pytest_terminal_summary(terminalreporter, config) -> None:
    if _TREE_REPORT.rows:
        terminalreporter.section("Megatron-LM tree under the pp suite")
        for line in _TREE_REPORT.lines():
            terminalreporter.write_line(line)


class TreeRuns:
    """The tree of `$MHC_MEGATRON_LM` (validated and imported once) and its single-process reference runs: the
    dense GPT (`"dense"`), with MoE MLPs (`"moe"`), with two MTP depths (`"mtp"`) and its `HybridModel` of the pattern
    `*-*E` (`"hybrid"`), each launched on first use."""

    FLAGS = {
        "dense": [],
        "moe": ["--moe", "alltoall"],
        "mtp": ["--mtp", "2"],
        "hybrid": ["--hybrid", "*-*E"],
        "hybrid-mtp": ["--hybrid", "*-*E/*E"],
    }

    def __init__(self, tree, root: Path) -> None:
        self.tree, self.root = tree, root
        self._refs: dict[str, Path] = {}
        self._failed: dict[str, Exception] = {}

    def reference(self, model: str = "dense") -> Path:
        """The tree's single-process run of `model` (init.pt + rank0.pt), launched on first use."""
        from suites.pp.launch import run_worker

        if model in self._failed:
            raise self._failed[model]
        if model not in self._refs:
            out = self.root / f"tree-reference-{model}"
            try:
                run_worker(
                    out,
                    1,
                    ["--impl", "tree", "--flavor", self.tree.flavor, *self.FLAGS[model]],
                    tree=self.tree.path,
                )
            except Exception as exc:
                self._failed[model] = exc
                raise
            self._refs[model] = out
        return self._refs[model]


@pytest.fixture(scope="session")
def tree_runs(megatron_lm_tree, tmp_path_factory, tree_report) -> TreeRuns:
    """The tree's runs of this session (`TreeRuns`)."""
    tree_report.label = megatron_lm_tree.label
    return TreeRuns(megatron_lm_tree, tmp_path_factory.mktemp("pp-tree"))
