"""Activation memory of a forward pass: the bytes autograd keeps for backward, on any device.

`saved_activation_bytes(fn, params)` runs `fn()` under `torch.autograd.graph.saved_tensors_hooks`
and sums the distinct storages of the tensors saved for backward, leaving out the storages of
`params` (a weight saved by a matmul is not activation memory). Deterministic, so it is a figure
a CPU run can report exactly; on CUDA `peak_bytes` adds the allocator's peak over a call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["saved_activation_bytes", "retained_bytes", "peak_bytes"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def saved_activation_bytes(fn: Callable[[], object], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs, parameters excluded.

    The result of `fn()` is kept alive until the count is taken, so its graph (and what the graph
    saved) is the one measured; it is released on return.
    """
    skip = {_storage_key(p) for p in params}
    seen: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    total = sum(seen.values())
    del out
    return total


def retained_bytes(fn: Callable[[], object]) -> int:
    """Bytes allocated while `fn()` runs and still allocated when it returns, its result kept (so its graph and
    everything the graph holds): the profiler's net allocation over the call's operators (`profile_memory`).
    Unlike `saved_activation_bytes`, it sees what a saved-tensor hook of the code under test keeps (mHC recompute's
    anchor and the tensors it saves itself), on CPU and CUDA alike."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        out = fn()
    events = prof.events()
    total = sum(e.self_cpu_memory_usage + getattr(e, "self_device_memory_usage", 0) for e in events)
    del out
    return int(total)


def peak_bytes(fn: Callable[[], object], device: str) -> int | None:
    """Peak CUDA memory allocated during `fn()` above what was allocated before it; None off CUDA."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
