"""Fixtures of the pipeline-parallel suite: the single-process reference runs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the pp suite needs megatron-core")

from suites.pp.launch import run_worker  # noqa: E402


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory) -> dict[str, Path]:
    """Single-process (PP = TP = 1) runs, with and without mHC; each writes init.pt + rank0.pt."""
    root = tmp_path_factory.mktemp("pp-reference")
    runs = {}
    for name, extra in (("mhc", []), ("no-mhc", ["--no-mhc"])):
        run_worker(root / name, 1, extra)
        runs[name] = root / name
    return runs
