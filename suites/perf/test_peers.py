"""Peers beside ours: each peer's op timed in the same run as ours and a same-bytes copy.

Per benchmark (`suites/perf/peers.py` says what runs): the peer's median, bytes/s under the bytes
model of the ops ours runs, its roofline ratio against the copy timed in the same run, ours on the
compiled and reference backends in the same alternation, and `speedup_vs_peer` (the peer's time
over our compiled backend's: > 1 is ours faster); on a GPU also ours on cutile (`speedup_vs_peer_cutile`)
and both GPU busy times and their ratio. A peer is timed only where its outputs at this
shape match our reference within the bound (`conforms_at`), and `extra_info["conformance"]` says
so, with the conformance matrix's verdict for that op. Nothing here asserts a speed.
"""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

import pytest
import torch

from mhc_core.kernels import dispatch
from suites.perf.peers import (
    PeerCase,
    PeerTimed,
    ours,
    paired_fns,
    peer_cases,
    peer_golden,
    peer_golden_case,
    peer_info,
    registry_peers,
    runner,
)
from suites.perf.timing import paired_samples, synced
from tools.device_time import device_busy_seconds

if TYPE_CHECKING:
    from harness.conformance.matrix import PeerResult

pytestmark = pytest.mark.perf
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_MATRIX: dict[str, PeerResult] = {}


def _matrix_verdict(peer: PeerTimed, case: PeerCase) -> str:
    """The conformance matrix's verdict for this op family and dtype (cached per peer)."""
    from harness.conformance.matrix import run_matrix
    from harness.conformance.registry import select

    if peer.conformance_peer not in _MATRIX:
        _MATRIX[peer.conformance_peer] = run_matrix(select([peer.conformance_peer])).peers[0]
    row = _MATRIX[peer.conformance_peer]
    if row.skipped:
        return f"matrix: skipped ({row.skipped})"
    family = {"coefficients": ("coefficients",), "layer_mhc": ("layer", "mix"), "sinkhorn": ("sinkhorn",)}[
        case.op
    ]
    cells = [c for c in row.cells(peer.variant) if c.check.startswith(family)]
    bad = [c.check for c in cells if c.status != "pass"]
    return (
        f"matrix vs {peer.variant}: {len(cells) - len(bad)}/{len(cells)} {'/'.join(family)} checks pass"
        + (f" (not: {', '.join(bad)})" if bad else "")
    )


@pytest.mark.parametrize("peer", registry_peers(), ids=lambda p: p.name)
@pytest.mark.parametrize("direction", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("case", peer_cases(DEVICE), ids=lambda c: c.id)
def test_peer(benchmark, golden_metrics, case, direction, peer, reps):
    """Time one peer's op beside ours (compiled and reference) and a copy of the same bytes."""
    why = peer.unavailable(case)
    if why:
        pytest.skip(why)
    ok, why = dispatch.availability("compiled", DEVICE)
    if not ok:
        pytest.skip(f"our compiled backend is unavailable here: {why}")
    conforms, worst = peer.conforms_at(case)
    verdict = _matrix_verdict(peer, case)
    if not conforms:
        pytest.skip(
            f"{peer.name} does not conform to {peer.variant} at {case.id} ({worst}); not timed. {verdict}"
        )
    inputs = case.inputs(requires_grad=direction == "fwdbwd")
    fns = paired_fns(peer.build(case), case, inputs, direction, peer.variant)
    cutile, _ = dispatch.availability("cutile", DEVICE)
    if cutile:  # on an NVIDIA GPU, ours as a run would pick it too
        fns.append(runner(ours(case, "cutile", peer.variant), inputs, direction))
    timed = paired_samples(fns, device=DEVICE, reps=reps, warmup=2)  # warm-up 1 compiles, 2 settles
    benchmark.group = f"peer-{case.op}-{direction}"
    benchmark.pedantic(synced(fns[0], device=DEVICE), rounds=max(3, reps // 2), warmup_rounds=1, iterations=1)
    info = peer_info(case, direction, peer.name, peer.variant, timed[:4], f"at {case.id}: {worst}; {verdict}")
    if cutile:
        cutile_s = statistics.median(timed[4])
        info.update({"ours_cutile_s": cutile_s, "speedup_vs_peer_cutile": info["median_s"] / cutile_s})
    busy, ours_busy = (device_busy_seconds(fn, DEVICE, calls=5) for fn in (fns[0], fns[2]))
    if busy is not None:
        # GPU busy time per call (the kernels alone), the peer's and ours, and the ratio of the two.
        info.update(
            {"device_busy_s": busy, "ours_device_busy_s": ours_busy, "speedup_vs_peer_busy": busy / ours_busy}
        )
    benchmark.extra_info.update(info)
    assert info["median_s"] > 0 and info["ours_compiled_s"] > 0 and info["roofline_ratio"] > 0
    if os.environ.get("MHC_PERF_GOLDEN") == "1":
        golden_metrics.check(
            peer_golden_case(case, direction, peer.name), *peer_golden(timed[0], timed[2], DEVICE)
        )
