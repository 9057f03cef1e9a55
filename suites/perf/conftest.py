"""The perf suite: pytest-benchmark, never under xdist; benchmarks measure, tests assert nothing about speed.

Process settings made here (each recorded in the JSON's `machine_info.mhc`):

- CPU heap retention: glibc serves blocks over its mmap threshold (128 KiB, growing to 32 MiB)
  with fresh mmaps, so every large output of an out-of-place op is first-touch page faulted;
  at T = 4096, C = 1024 that costs more than the kernel itself and hides it. The suite raises
  M_MMAP_THRESHOLD / M_TRIM_THRESHOLD to 1 GiB so freed buffers are reused, as a GPU caching
  allocator does. Opt out with MHC_PERF_MALLOC_RETAIN=0.
- Inductor compiles in-process (compile_threads = 1) unless TORCHINDUCTOR_COMPILE_THREADS is set:
  on a 2-core box the worker pool is slower.
- MHC_NSYS_SQLITE=<export.sqlite>: per-benchmark GPU kernel time from a previous profiled run
  (`suites/perf/nsys.py`) is added to `extra_info` as `nsys_kernel_s`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import pytest
import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_RETAIN_BYTES = 1 << 30
_SETTINGS: dict[str, object] = {}


def _retain_heap() -> str:
    if os.environ.get("MHC_PERF_MALLOC_RETAIN", "1") == "0":
        return "off (MHC_PERF_MALLOC_RETAIN=0)"
    if not sys.platform.startswith("linux"):
        return f"n/a ({sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN_BYTES) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN_BYTES) == 1
    except (OSError, AttributeError) as exc:
        return f"unavailable ({exc})"
    return "on (mmap/trim threshold 1 GiB)" if ok else "mallopt refused"


def check_not_xdist(config: pytest.Config) -> None:
    """Refuse xdist workers and `-n N`: parallel benchmarks measure each other."""
    if os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("suites/perf must not run under xdist: run it with -p no:xdist")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse xdist; set the process up for timing."""
    check_not_xdist(config)
    _SETTINGS["malloc_retain"] = _retain_heap()
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

    machine_info["mhc"] = dict(_SETTINGS, torch=torch.__version__, cutile_tuning=tuning.describe(tiling.active_tuning()))


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
