"""Fixtures of the pipeline-parallel suite: the single-process reference runs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the pp suite needs megatron-core")

from suites.pp.launch import run_worker  # noqa: E402


class ReferenceRuns:
    """Single-process (PP = TP = 1) runs, with (`"mhc"`) and without (`"no-mhc"`) mHC, with MoE MLPs
    (`"mhc-moe"`), with two MTP depths under dev's numerics (`"mhc-mtp"`), and the hybrid stack `*-*E` (`"mhc-hybrid"`; with an MTP depth `*E` under dev's numerics:
    `"mhc-hybrid-mtp"`),
    each run on its first lookup (so a selection without the no-mHC case launches one); each writes init.pt + rank0.pt."""

    FLAGS = {"mhc": [], "no-mhc": ["--no-mhc"], "mhc-moe": ["--moe", "alltoall"],
             "mhc-mtp": ["--mtp", "2", "--numerics", "dev"], "mhc-hybrid": ["--hybrid", "*-*E"],
             "mhc-hybrid-mtp": ["--hybrid", "*-*E/*E", "--numerics", "dev"]}

    def __init__(self, root: Path) -> None:
        self.root, self.done, self.failed = root, set(), {}

    def __getitem__(self, name: str) -> Path:
        if name in self.failed:  # a failed reference is launched once, its error raised for each test
            raise self.failed[name]
        if name not in self.done:
            try:
                run_worker(self.root / name, 1, self.FLAGS[name])
            except Exception as exc:
                self.failed[name] = exc
                raise
            self.done.add(name)
        return self.root / name


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory) -> ReferenceRuns:
    """The single-process reference runs (`ReferenceRuns`)."""
    return ReferenceRuns(tmp_path_factory.mktemp("pp-reference"))


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

        out = [f"Megatron-LM tree {self.label}: worst relative difference, loss / grad / weight",
               f"{'case':<28} {'tree vs its single process':<30} tree vs ours"]
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

    FLAGS = {"dense": [], "moe": ["--moe", "alltoall"], "mtp": ["--mtp", "2"], "hybrid": ["--hybrid", "*-*E"],
             "hybrid-mtp": ["--hybrid", "*-*E/*E"]}

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
                run_worker(out, 1, ["--impl", "tree", "--flavor", self.tree.flavor, *self.FLAGS[model]],
                           tree=self.tree.path)
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
