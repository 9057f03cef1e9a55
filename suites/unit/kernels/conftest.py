"""Kernel parity suite: keep torch.compile's cost bounded on small CI machines.

Inductor compiles each graph's C++ in a pool of worker processes by default; with 2 cores and
2 xdist workers the pool costs more than it saves (measured: 120 s -> 70 s for this directory,
cold cache). Unless TORCHINDUCTOR_COMPILE_THREADS is set, compile in-process on a machine of at
most `SMALL_MACHINE_CPUS` usable cores (this process's CPU affinity, as a container's CPU set
limits it); a larger one (a GPU node) keeps Inductor's own pool.
"""

from __future__ import annotations

import os

import pytest

SMALL_MACHINE_CPUS = 4

_VERDICTS: list[dict] = []
"""The `determinism` properties of this session's reports (test_determinism.py), in arrival order."""


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_configure(config):
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ and _usable_cpus() <= SMALL_MACHINE_CPUS:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1


@pytest.fixture
def cutile_on_cpu(monkeypatch):
    """cuTile "available" for CPU tensors, its ops the real kernels on the CPU interpreter (the
    kernels' own coverage checks raise), the other backends as they are."""
    from mhc_core.kernels import dispatch
    from mhc_core.kernels.cutile import CuTileBackend
    from tools.cutile.emulator import EmulatedRuntime

    emulated = CuTileBackend(EmulatedRuntime(num_sms=4))
    real_availability, real_backend = dispatch.availability, dispatch.get_backend
    monkeypatch.setattr(
        dispatch,
        "availability",
        lambda backend, device=None: (
            (True, "cuTile on the CPU interpreter (test)")
            if backend == "cutile"
            else real_availability(backend, device)
        ),
    )
    monkeypatch.setattr(
        dispatch, "get_backend", lambda backend: emulated if backend == "cutile" else real_backend(backend)
    )


def pytest_runtest_logreport(report):
    if report.when == "call":
        _VERDICTS.extend(v for k, v in report.user_properties if k == "determinism")


def pytest_terminal_summary(terminalreporter, config):
    if not _VERDICTS:
        return
    from harness.conformance.determinism import Verdict, verdict_table

    terminalreporter.section("determinism per backend and kernel (max abs difference; 0 = bitwise)")
    verdicts = sorted((Verdict(**v) for v in _VERDICTS), key=lambda v: v.subject)
    for line in verdict_table(verdicts).splitlines():
        terminalreporter.line(line)
