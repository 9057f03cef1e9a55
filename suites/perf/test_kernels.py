"""Kernel benchmarks: every op x shape x backend, forward and forward+backward.

Per benchmark, `extra_info` holds the bytes-moved model, achieved bytes/s, the bandwidth of a
plain copy of the same bytes measured in the same run, their ratio (the roofline ratio) and, for
fused backends, the speed-up over `reference` in the same run; on a GPU the same two ratios again
from back-to-back calls (`*_pipelined`: the kernels' own time, without the launch cost that a
single timed call includes whenever the GPU waits for the host, unless the host is the slower
side even then), and the GPU busy time per call (`device_busy_s`, `tools.device_time`:
the kernels alone). Nothing here asserts a speed.
Perf goldens (two-sided band on the median time) are compared only with MHC_PERF_GOLDEN=1 (the
nightly GPU job), never in CPU CI.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from harness import TimingCheck
from mhc_core.kernels import dispatch
from mhc_core.kernels.preflight import cutile_gap
from suites.perf.nsys import RANGE_PREFIX
from suites.perf.peers import smoke
from suites.perf.timing import copy_fn, paired_samples, pipelined_seconds, synced
from tools.device_time import device_busy_seconds
from tools.perf_cases import PerfCase, cases_for, cpu_gap

pytestmark = pytest.mark.perf
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("reference", "compiled", "cutile")


def _runner(case: PerfCase, backend: str, direction: str):
    impl = dispatch.op_on(case.op, backend)
    args = case.inputs(requires_grad=direction == "fwdbwd")
    if direction == "fwd":

        def fwd():
            with torch.no_grad():
                return impl(*args)

        return fwd
    outs = impl(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def fwdbwd():
        o = impl(*args)
        o = o if isinstance(o, tuple) else (o,)
        return torch.autograd.grad(o, leaves, grads)

    return fwdbwd


def _nvtx(fn, label: str):
    """`fn` inside an NVTX range (GPU only), so an nsys export can attribute its kernels."""
    if DEVICE != "cuda":
        return fn

    def wrapped():
        with torch.cuda.nvtx.range(label):
            return fn()

    return wrapped


def _all_finite(result) -> bool:
    tensors = result if isinstance(result, tuple) else (result,)
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors if isinstance(t, torch.Tensor))


def _bytes(case: PerfCase, direction: str) -> int:
    return case.bytes("fwd") + (case.bytes("bwd") if direction == "fwdbwd" else 0)


SMOKE_TOKENS, SMOKE_ITERATIONS = 1024, 4
"""The token count and Sinkhorn iterations of CI's smoke run (`MHC_PERF_SMOKE=1`): every op, dtype and width, a
quarter of the tokens on CPU and 4 iterations (the compiled sinkhorn and pre unroll them: 20 cost about a minute of
cold compilation more); its figures are no measurement, `tox -e perf` alone times the registry's."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["fwd", "fwdbwd"])
@pytest.mark.parametrize(
    "case",
    cases_for(DEVICE, tokens=SMOKE_TOKENS, iterations=SMOKE_ITERATIONS)
    if smoke() and DEVICE == "cpu"
    else cases_for(DEVICE),
    ids=lambda c: c.id,
)
def test_kernel(benchmark, golden_metrics, nsys_ranges, case, direction, backend, reps):
    """Time one op; record bytes/s, roofline ratio against a same-run copy, speed-up over reference."""
    ok, why = dispatch.availability(backend, DEVICE)
    if not ok:
        pytest.skip(f"backend {backend} unavailable: {why}")
    gap = (
        cutile_gap(case.op, n=case.n, dtype=case.dtype, dropout=case.dropout) if backend == "cutile" else None
    )
    if gap:
        pytest.skip(f"no cuTile kernel for {case.id}: {gap}")
    gap = cpu_gap(case, direction)
    if gap:
        pytest.skip(f"{case.id} {direction}: {gap}")
    fn = _runner(case, backend, direction)
    nbytes = _bytes(case, direction)
    cuda_graph = DEVICE == "cuda" and os.environ.get("MHC_PERF_CUDA_GRAPH") == "1"
    # The op, the same-bytes copy and (for fused backends) the reference, alternated rep by rep.
    fns = [fn, copy_fn(nbytes, device=DEVICE)]
    if backend != "reference":
        fns.append(_runner(case, "reference", direction))
    timed = paired_samples(fns, device=DEVICE, reps=reps, warmup=3, cuda_graph=cuda_graph)
    samples = timed[0]
    seconds, copy_s = statistics.median(timed[0]), statistics.median(timed[1])
    benchmark.group = f"{case.op}-{direction}"
    label = f"{RANGE_PREFIX}{case.id}-{direction}-{backend}"
    result = benchmark.pedantic(
        synced(_nvtx(fn, label), device=DEVICE), rounds=max(3, reps // 2), warmup_rounds=1, iterations=1
    )

    info = {
        "op": case.op,
        "direction": direction,
        "backend": backend,
        "shape": case.id,
        "device": DEVICE,
        "median_s": seconds,
        "bytes": nbytes,
        "bytes_per_s": nbytes / seconds,
        "copy_bytes_per_s": nbytes / copy_s,
        "roofline_ratio": copy_s / seconds,
    }
    if backend != "reference":
        info["speedup_vs_reference"] = statistics.median(timed[2]) / seconds
    if DEVICE == "cuda":
        # Back-to-back calls: the kernels' own time without the host's launch cost. Not on CPU, where
        # a call is synchronous anyway and unflushed repeats only measure the caches.
        piped = pipelined_seconds(fns, device=DEVICE, iters=10, rounds=3)
        info.update({"pipelined_s": piped[0], "roofline_ratio_pipelined": piped[1] / piped[0]})
        if backend != "reference":
            info["speedup_vs_reference_pipelined"] = piped[2] / piped[0]
    busy = device_busy_seconds(fn, DEVICE, calls=5)
    if busy is not None:
        # The kernels alone (GPU busy time per call, `tools.device_time`): for small ops
        # the timed calls above measure the host's launch path as much as the kernels.
        info.update({"device_busy_s": busy, "bytes_per_s_busy": nbytes / busy})
    if label in nsys_ranges:
        info["nsys_kernel_s"] = nsys_ranges[label].per_instance_s
    benchmark.extra_info.update(info)
    assert seconds > 0 and nbytes > 0 and info["roofline_ratio"] > 0
    assert _all_finite(result), f"{case.id} {direction} {backend}: non-finite output"

    if os.environ.get("MHC_PERF_GOLDEN") == "1":
        golden_metrics.check(
            f"{case.id}-{direction}-{backend}",
            {"iteration-time": samples},
            {"iteration-time": TimingCheck(rel_band_slow=0.15, rel_band_fast=0.30, window=(1, len(samples)))},
        )
