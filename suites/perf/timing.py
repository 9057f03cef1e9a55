"""Timers: host clock on CPU, CUDA events (L2 flushed, optional CUDA graph) on GPU; copy bandwidth; the
CPU heap retention every timing process sets."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tools.timing import pipelined_ms

__all__ = [
    "sample_seconds",
    "median_seconds",
    "copy_seconds",
    "paired_samples",
    "copy_fn",
    "pipelined_seconds",
    "retain_heap",
    "synced",
]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_RETAIN_BYTES = 1 << 30


def retain_heap() -> str:
    """Keep freed CPU buffers for reuse, and say so: glibc serves blocks over its mmap threshold (128 KiB, growing
    to 32 MiB) with fresh mmaps, so every large output of an out-of-place op is first-touch page faulted; at
    T = 4096, C = 1024 that costs more than the kernel itself and hides it. M_MMAP_THRESHOLD / M_TRIM_THRESHOLD
    go to 1 GiB, as a GPU caching allocator keeps its blocks. `MHC_PERF_MALLOC_RETAIN=0` opts out."""
    if os.environ.get("MHC_PERF_MALLOC_RETAIN", "1") == "0":
        return "off (MHC_PERF_MALLOC_RETAIN=0)"
    if not sys.platform.startswith("linux"):
        return f"n/a ({sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN_BYTES) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN_BYTES) == 1
        )
    except (OSError, AttributeError) as exc:
        return f"unavailable ({exc})"
    return "on (mmap/trim threshold 1 GiB)" if ok else "mallopt refused"


_L2_FLUSH_BYTES = 256 * 1024 * 1024


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(
    fn: Callable[[], object], *, device: str, reps: int, warmup: int = 2, cuda_graph: bool = False
) -> float:
    """Median of `sample_seconds`."""
    return statistics.median(
        sample_seconds(fn, device=device, reps=reps, warmup=warmup, cuda_graph=cuda_graph)
    )


def sample_seconds(
    fn: Callable[[], object], *, device: str, reps: int, warmup: int = 2, cuda_graph: bool = False
) -> list[float]:
    """Seconds of each of `reps` runs of `fn()` after `warmup` runs.

    On CUDA each rep is timed with a pair of CUDA events around the launch, after writing a
    256 MiB buffer so L2 starts cold; with `cuda_graph`, `fn` is captured once and replayed.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    if device != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    run = fn
    if cuda_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def copy_seconds(nbytes: int, *, device: str, reps: int) -> float:
    """Median seconds of `dst.copy_(src)` moving `nbytes` in total (nbytes / 2 read, nbytes / 2 written)."""
    half = max(nbytes // 2, 1)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), device=device, reps=reps)


def copy_fn(nbytes: int, *, device: str) -> Callable[[], object]:
    """`dst.copy_(src)` moving `nbytes` in total (nbytes / 2 read, nbytes / 2 written)."""
    half = max(nbytes // 2, 1)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def paired_samples(
    fns: list[Callable[[], object]], *, device: str, reps: int, warmup: int = 2, cuda_graph: bool = False
) -> list[list[float]]:
    """Seconds of each fn, measured rep by rep in alternation, so that every ratio between them
    is taken under the same machine load (a shared CI box changes speed minute to minute)."""
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            out[i] += sample_seconds(
                fn, device=device, reps=1, warmup=warmup if not out[i] else 0, cuda_graph=cuda_graph
            )
    return out


def pipelined_seconds(
    fns: list[Callable[[], object]], *, device: str, iters: int, rounds: int
) -> list[float]:
    """Seconds per call of each fn when `iters` calls run back to back (no flush, one timer pair),
    the median over `rounds` rounds that alternate the fns.

    On CUDA this hides the host's launch cost behind the GPU's work, so it is the kernels' own
    time (what a training step, whose host runs ahead, pays); the single-call samples above
    include the launch whenever the GPU has to wait for it.
    """
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            out[i].append(pipelined_ms(fn, iters, device) / 1e3)
    return [statistics.median(v) for v in out]


def synced(fn: Callable[[], object], *, device: str) -> Callable[[], object]:
    """`fn` followed by a device synchronisation, so that a host timer around it (pytest-benchmark's
    own rounds, which feed the perf history) measures the GPU work and not only its launch."""
    if device != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize()
        return out

    return run
