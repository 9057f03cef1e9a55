"""How long the GPU actually computes during a call: the union of its kernels' intervals.

A call's wall time (CUDA events around it, even around back-to-back calls) includes the gaps
where the GPU waits for the host to launch the next kernel. `device_busy_seconds(fn, device,
calls)` profiles `calls` back-to-back calls (`torch.profiler`, CUDA activity: kernels, memcpys,
memsets) and returns the length of the union of those intervals per call, i.e. the time a call
would take if launches cost nothing (a CUDA graph comes close). Wall time over busy time near 1
means the call is GPU-bound; well above 1, host-bound, and faster kernels would not shorten it.
None off CUDA. Used by the tile sweep (`tools.cutile.sweep`: which tile is fastest on the GPU, whatever
the host costs) and the perf suite's layer overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["busy_seconds", "device_busy_seconds"]


def busy_seconds(intervals_us: Iterable[tuple[float, float]]) -> float:
    """Length in seconds of the union of `[start, end]` intervals given in microseconds (kernels
    on several streams may overlap; each instant counts once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals_us):
        if end < start:
            raise ValueError(f"busy_seconds: interval ({start}, {end}) ends before it starts")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total * 1e-6


def device_busy_seconds(fn: Callable[[], object], device: str, calls: int = 1) -> float | None:
    """GPU busy time per call of `calls` back-to-back `fn()` (after one unprofiled warm-up call);
    None off CUDA."""
    if device != "cuda":
        return None
    if calls < 1:
        raise ValueError(f"device_busy_seconds: calls={calls} must be >= 1")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    if spans:
        return busy_seconds(spans) / calls
    # Torch versions that only attach kernels to their launching op: durations, no start times,
    # so a sum (the same on one stream).
    total_us = sum(k.duration for e in events for k in getattr(e, "kernels", ()))
    if total_us <= 0:
        raise RuntimeError("device_busy_seconds: the profiler recorded no CUDA activity for the call")
    return total_us * 1e-6 / calls
