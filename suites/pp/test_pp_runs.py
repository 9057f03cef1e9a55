"""Real multi-process pipeline runs (torchrun, gloo): loss, gradients and weights equal the
single-process run, and every P2P hop carries the n-stream width."""

from __future__ import annotations

import re
import time

import pytest

from harness.launch.torchrun import LaunchError, live_pids
from suites.pp.batches import Batches, Planned
from suites.pp.cases import CASES, ROUNDED_HANDOFF
from suites.pp.compare_runs import compare_to_reference, differences_by_layer, load_run, worst_differences
from suites.pp.launch import run_worker

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pipelined_run_reproduces_single_process(case, reference_runs, pipelined_runs):
    """Every microbatch loss, gradient and post-step weight equals the single-process run."""
    ref_dir = reference_runs[case.reference_run]
    ref, run = load_run(ref_dir), load_run(pipelined_runs[case.name])
    problems = compare_to_reference(run, ref, case.rtol)
    print(f"{case.name}: worst relative difference {worst_differences(run, ref)}")
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:20])
    assert len(run.losses) == 2 and len(run.losses[0]) == 4
    if "--moe" in case.args:  # the routers' losses were tracked, every layer's on some rank
        assert all(bool((step["load_balancing_loss"] > 0).all()) for step in run.aux_losses), run.aux_losses
    depths = (
        int(case.args[case.args.index("--mtp") + 1])
        if "--mtp" in case.args
        else sum(a.count("/") for a in case.args)
    )
    if depths:  # each microbatch's loss of each depth was tracked
        assert all(len(mb) == depths and min(mb) > 0 for step in run.mtp_losses for mb in step), (
            run.mtp_losses
        )

    if "--pp" not in case.args:  # no pipeline: no P2P traffic to check
        assert all(not shapes for shapes in run.shapes.values()), run.shapes
        return
    # Shapes: every send of rank r has the width the next rank receives; n*C with mHC, C without, the single-pass
    # carrier's n*C + k.
    width = case.width
    for rank, shapes in run.shapes.items():
        assert shapes, f"rank {rank} recorded no P2P traffic"
        widths = {s[-1] for _, s in shapes}
        assert widths == {width}, f"rank {rank} P2P widths {sorted(widths)}, expected {width}"
    sends = sorted({s for r in run.shapes.values() for kind, s in r if kind.startswith("send")})
    recvs = sorted({s for r in run.shapes.values() for kind, s in r if kind.startswith("recv")})
    assert sends == recvs, f"sent shapes {sends} != received shapes {recvs}"


@pytest.mark.parametrize("case", [ROUNDED_HANDOFF], ids=lambda c: c.name)
def test_a_rounded_handoff_moves_a_bf16_run(case, reference_runs, pipelined_runs):
    """Upstream DSv41HybridStack's packing, the H_pre rounded to bf16 at each stage boundary (n channels), is not
    the single process: the loss and the gradients of the layers on both sides of each boundary move (printed by
    layer; the exact handoff's runs are bitwise, `sp-pp4-bf16`)."""
    ref, run = load_run(reference_runs[case.reference_run]), load_run(pipelined_runs[case.name])
    worst = worst_differences(run, ref)
    print(f"{case.name}: worst relative difference {worst}")
    for layer, diff in differences_by_layer(run, ref).items():
        print(f"  {layer}: grad {diff['grad']:.2e}, weight {diff['weight']:.2e}")
    assert {s[-1] for shapes in run.shapes.values() for _, s in shapes} == {case.width}
    assert worst["loss"] > 0 and worst["grad"] > 1e-4, worst


def test_crashed_rank_fails_with_its_stderr_and_leaves_nothing(reference_runs, tmp_path):
    """Rank 1 dies mid-run in a batch after a good case: the good case stays done, the crashed one fails fast
    alone naming the failure, and no worker survives."""
    init = reference_runs["mhc"] / "init.pt"
    runs = Batches(tmp_path)
    runs.plan("good", Planned(nproc=2, args=("--pp", "2", "--init", str(init))))
    runs.plan("crash", Planned(nproc=2, args=("--pp", "2", "--init", str(init), "--crash-rank", "1")))
    start = time.monotonic()
    good = runs["good"]  # the batch of both: it fails in the second case
    assert runs.done == {"good"} and (tmp_path / "batch-2ranks").is_dir(), runs.done
    assert len(load_run(good).losses) == 2
    with pytest.raises(LaunchError) as err:
        runs["crash"]
    assert time.monotonic() - start < 120
    message = str(err.value)
    assert "exited with code" in message and "2 ranks" in message
    assert re.search(r"exitcode\s*:\s*17\b", err.value.result.output), err.value.result.output[-2000:]
    assert not live_pids("pp_worker.py", str(tmp_path))


def test_hung_rank_is_killed_at_the_timeout(reference_runs, tmp_path):
    """A rank that never arrives: the launch is killed at the timeout with rank logs, nothing left."""
    init = reference_runs["mhc"] / "init.pt"
    with pytest.raises(LaunchError) as err:
        # Rank 0 of a PP=2 run whose rank 1 hangs before the first P2P: rank 0 blocks in recv.
        run_worker(tmp_path, 2, ["--pp", "2", "--init", str(init), "--hang-rank", "1"], timeout=12)
    assert err.value.result.timed_out
    assert "timed out after 12 s and was killed" in str(err.value)
    assert "--- rank 0 stderr" in str(err.value)
    assert not live_pids("pp_worker.py", str(tmp_path))
