"""The perf suite: pytest-benchmark, never under xdist; benchmarks measure, tests assert nothing about speed."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Refuse xdist workers: parallel benchmarks measure each other."""
    if os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("suites/perf must not run under xdist: run it with -p no:xdist")


@pytest.fixture(scope="session")
def device() -> str:
    """cuda when a GPU is present, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def reps(device: str) -> int:
    """Timed repetitions per measurement (override with MHC_PERF_REPS)."""
    return int(os.environ.get("MHC_PERF_REPS", "20" if device == "cuda" else "5"))
