"""Fixtures of the pipeline-parallel suite: the single-process reference runs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the pp suite needs megatron-core")

from suites.pp.launch import run_worker  # noqa: E402


class ReferenceRuns:
    """Single-process (PP = TP = 1) runs, with (`"mhc"`) and without (`"no-mhc"`) mHC, each run on its
    first lookup (so a selection without the no-mHC case launches one); each writes init.pt + rank0.pt."""

    FLAGS = {"mhc": [], "no-mhc": ["--no-mhc"]}

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
