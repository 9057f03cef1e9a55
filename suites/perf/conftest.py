"""The perf suite: pytest-benchmark, never under xdist; benchmarks measure, tests assert nothing about speed.

Process settings made here (each recorded in the JSON's `machine_info.mhc`):

- CPU heap retention (`suites.perf.timing.retain_heap`, as `tree_peers` sets it too): freed buffers are
  reused instead of page faulted afresh, as a GPU caching allocator does. Opt out with
  MHC_PERF_MALLOC_RETAIN=0.
- Inductor compiles in-process (compile_threads = 1) unless TORCHINDUCTOR_COMPILE_THREADS is set:
  on a 2-core box the worker pool is slower.
- MHC_NSYS_SQLITE=<export.sqlite>: per-benchmark GPU kernel time from a previous profiled run
  (`suites/perf/nsys.py`) is added to `extra_info` as `nsys_kernel_s`.
"""

from __future__ import annotations

import os

import pytest
import torch

from suites.perf.timing import retain_heap

_SETTINGS: dict[str, object] = {}


def check_not_xdist(config: pytest.Config) -> None:
    """Refuse xdist workers and `-n N`: parallel benchmarks measure each other."""
    if os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("suites/perf must not run under xdist: run it with -p no:xdist")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse xdist; set the process up for timing."""
    check_not_xdist(config)
    _SETTINGS["malloc_retain"] = retain_heap()
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
        _SETTINGS["inductor_compile_threads"] = 1
    _SETTINGS["torch_threads"] = torch.get_num_threads()
    _SETTINGS["cuda_graph"] = os.environ.get("MHC_PERF_CUDA_GRAPH") == "1"


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record the process settings next to the machine description, with the cuTile tuning in force
    (set on the first cuTile launch; "none" when nothing launched or no tuning applies)."""
    from mhc_core.kernels.cutile import tiling, tuning

    machine_info["mhc"] = dict(
        _SETTINGS, torch=torch.__version__, cutile_tuning=tuning.describe(tiling.active_tuning())
    )


@pytest.fixture(scope="session")
def device() -> str:
    """cuda when a GPU is present, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def reps(device: str) -> int:
    """Timed repetitions per measurement (override with MHC_PERF_REPS)."""
    return int(os.environ.get("MHC_PERF_REPS", "20" if device == "cuda" else "5"))


@pytest.fixture(scope="session")
def nsys_ranges() -> dict:
    """NVTX range name -> `RangeStat` from MHC_NSYS_SQLITE (empty when unset)."""
    path = os.environ.get("MHC_NSYS_SQLITE")
    if not path:
        return {}
    from suites.perf.nsys import RANGE_PREFIX, nvtx_kernel_seconds

    return nvtx_kernel_seconds(path, prefix=RANGE_PREFIX)
