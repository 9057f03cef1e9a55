"""Wall-clock timing of one callable: single calls and back-to-back calls (CUDA events on a GPU).

The perf suite and the kernel tools time with these; GPU busy time (the kernels alone) is
`device_time`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["pipelined_ms", "time_ms"]


def time_ms(fn: Callable[[], object], warmup: int, iters: int, device: str = "cuda") -> float:
    """Median milliseconds of `iters` single calls after `warmup` untimed ones: CUDA events on a GPU,
    the host clock on `device="cpu"` (the CPU interpreter: what the tests run the tools with)."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def pipelined_ms(fn: Callable[[], object], iters: int, device: str = "cuda") -> float:
    """Milliseconds per call of `iters` back-to-back calls between one pair of CUDA events, after
    one untimed call: the kernels' own time once the host's launch cost is hidden (host clock on
    `device="cpu"`)."""
    fn()
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
