"""Fixtures of the functional suite: the hardware key and the session's runs (`session.py`)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the functional suite needs megatron-core")

from typing import Any  # noqa: E402

from harness.golden.hardware import detect_hardware  # noqa: E402
from suites.functional.session import MULTINODE_TIMES, RETAINED_BYTES, STEP_TIME_RATIO, FunctionalRuns  # noqa: E402


@pytest.fixture(scope="session")
def hw_key(request: pytest.FixtureRequest) -> str:
    """This machine's hardware key (`--hw`, `$MHC_HW`, else detection)."""
    return detect_hardware(override=request.config.getoption("hw")).key


@pytest.fixture(scope="session")
def functional_runs(tmp_path_factory: pytest.TempPathFactory, hw_key: str) -> FunctionalRuns:
    return FunctionalRuns(tmp_path_factory.mktemp("functional"), hw_key)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    ratios = config.stash.get(STEP_TIME_RATIO, {})
    if ratios:
        terminalreporter.section("mHC step time")
        for pair, ratio in ratios.items():
            terminalreporter.line(
                f"{pair}: step-time ratio {ratio:.3f} (fastest iteration-time of each run, warm-up skipped)"
            )
    times = config.stash.get(MULTINODE_TIMES, {})
    if times:
        terminalreporter.section("multi-node simulation")
        for case, (two, one) in times.items():
            terminalreporter.line(
                f"{case}: two agents x two ranks {two:.1f} s (the batch script: plan, both nodes, check); "
                f"one node x four ranks {one:.1f} s (the session's run, with its checkpoint saves)"
            )
    retained = config.stash.get(RETAINED_BYTES, {})
    if retained:
        terminalreporter.section("retained after a step (all ranks)")
        for shape, (first, kept, seconds) in retained.items():
            terminalreporter.line(
                f"{shape}: caches and buffers after step 1 {first:,} bytes; a later step's tensors megatron-core "
                f"keeps {kept:,} bytes; ours 0; checks {seconds:.1f} s"
            )
