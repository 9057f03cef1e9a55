"""Real multi-process pipeline runs (torchrun, gloo): loss, gradients and weights equal the
single-process run, and every P2P hop carries the n-stream width."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest

from harness.launch.torchrun import LaunchError, live_pids
from suites.pp.compare_runs import compare_to_reference, load_run, worst_differences
from suites.pp.launch import run_worker

HIDDEN, N = 32, 4
pytestmark = pytest.mark.distributed


@dataclass(frozen=True, kw_only=True)
class Case:
    """One pipelined run: ranks, worker flags, the reference it must reproduce, its tolerance."""

    name: str
    nproc: int
    args: tuple[str, ...]
    mhc: bool = True
    reference: str = "mhc"
    """The single-process run it must reproduce (`ReferenceRuns.FLAGS`)."""
    rtol: float = 1e-6
    """TP splits every matmul's reduction, and data parallelism the sum over microbatches, so those cases allow
    fp32 reordering (documented)."""


CASES = [
    Case(name="pp2", nproc=2, args=("--pp", "2")),
    Case(name="pp4", nproc=4, args=("--pp", "4")),
    Case(name="pp2-vpp2", nproc=2, args=("--pp", "2", "--vpp", "2")),
    Case(name="pp2-embedding-loss-stages", nproc=2, args=("--pp", "2", "--embedding-stage", "--loss-stage")),
    Case(name="tp2-pp2", nproc=4, args=("--tp", "2", "--pp", "2"), rtol=5e-6),
    Case(name="pp2-vpp2-no-mhc", nproc=2, args=("--pp", "2", "--vpp", "2", "--no-mhc"), mhc=False),
    # mHC recompute: the chunk-spanning groups are rebuilt in backward under the interleaved schedule.
    Case(name="pp2-vpp2-mhc-recompute", nproc=2, args=("--pp", "2", "--vpp", "2", "--mhc-recompute", "chunk")),
    # MoE MLPs (4 local experts, top-2, alltoall) under the MLP-side hyper connection; the routers'
    # load-balancing losses are compared per layer too.
    Case(name="pp2-moe", nproc=2, args=("--pp", "2", "--moe", "alltoall"), reference="mhc-moe"),
    Case(name="pp2-vpp2-moe", nproc=2, args=("--pp", "2", "--vpp", "2", "--moe", "alltoall"), reference="mhc-moe"),
    # Expert parallel: two experts per rank, tokens exchanged by the alltoall dispatcher over gloo, the two ranks
    # data-parallel (two microbatches each, gradients averaged as megatron's DDP does: each rank's microbatches
    # scaled by 1/2 and summed, then the ranks, where one process scales four by 1/4: fp32 reordering, measured
    # 5.4e-6 relative at worst, on an mHC alpha's gradient).
    Case(name="ep2-moe", nproc=2, args=("--ep", "2", "--moe", "alltoall"), reference="mhc-moe", rtol=1e-5),
    # Two MTP depths on the last stage (dev's numerics: each depth its own learned contraction), every
    # microbatch's mtp_1 / mtp_2 loss compared too. The word embedding's gradient is summed over the first and the
    # MTP stage (an all-reduce, as megatron's finalize_model_grads does) where one process accumulates both uses in
    # autograd's order: fp32 reordering, which moves the second step's gradients (measured in docs/pipeline.md).
    Case(name="pp2-mtp", nproc=2, args=("--pp", "2", "--mtp", "2", "--numerics", "dev"), reference="mhc-mtp",
         rtol=1e-5),
    Case(name="pp2-vpp2-mtp", nproc=2, args=("--pp", "2", "--vpp", "2", "--mtp", "2", "--numerics", "dev"),
         reference="mhc-mtp", rtol=1e-5),
    # PP 4 with the MTP depths and the loss on a stage of their own (no decoder layer there): the streams cross
    # into it, and it contracts them (megatron-core would put the final layernorm with the last decoder layer).
    Case(name="pp4-mtp-loss-stage", nproc=4, args=("--pp", "4", "--mtp", "2", "--numerics", "dev", "--layout",
                                                  "Et|tt|t|mmL"), reference="mhc-mtp", rtol=1e-5),
    # The hybrid stack (one hyper connection per layer: attention, MLP, attention, MoE) split at the pattern's
    # `|`: two stages, four, two of two virtual stages; and EP 2 (data parallel: measured 1.4e-6).
    Case(name="pp2-hybrid", nproc=2, args=("--pp", "2", "--hybrid", "*-|*E"), reference="mhc-hybrid"),
    Case(name="pp4-hybrid", nproc=4, args=("--pp", "4", "--hybrid", "*|-|*|E"), reference="mhc-hybrid"),
    Case(name="pp2-vpp2-hybrid", nproc=2, args=("--pp", "2", "--vpp", "2", "--hybrid", "*|-|*|E"),
         reference="mhc-hybrid"),
    Case(name="ep2-hybrid", nproc=2, args=("--ep", "2", "--hybrid", "*-*E"), reference="mhc-hybrid", rtol=1e-5),
    # DeepSeek-V4's shape: the hybrid stack with an MTP depth of its own pattern (`*-|*E/*E`: dev's unified form,
    # the depth's attention and MoE nested on the n streams) on the last stage, dev's numerics. The word embedding's
    # two copies sum their gradients over the embedding group, as in pp2-mtp: the same bound.
    Case(name="pp2-hybrid-mtp", nproc=2, args=("--pp", "2", "--hybrid", "*-|*E/*E", "--numerics", "dev"),
         reference="mhc-hybrid-mtp", rtol=1e-5),
    # TP 2 x PP 2 with MoE, which megatron-core runs sequence parallel only: the local spec's norms take it here
    # (mhc_core.megatron.norms). Each TP rank holds half the tokens, so every replicated parameter's gradient is
    # summed over the two ranks where one process sums all tokens at once: fp32 reordering, measured 1.0e-5
    # relative at worst, on an alpha_res gradient of 1e-9 (docs/pipeline.md).
    Case(name="tp2-pp2-sp-moe", nproc=4, args=("--tp", "2", "--pp", "2", "--sp", "--moe", "alltoall"),
         reference="mhc-moe", rtol=2e-5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pipelined_run_reproduces_single_process(case, reference_runs, tmp_path):
    """Every microbatch loss, gradient and post-step weight equals the single-process run."""
    ref_dir = reference_runs[case.reference if case.mhc else "no-mhc"]
    run_worker(tmp_path, case.nproc, [*case.args, "--init", str(ref_dir / "init.pt")])
    ref, run = load_run(ref_dir), load_run(tmp_path)
    problems = compare_to_reference(run, ref, case.rtol)
    print(f"{case.name}: worst relative difference {worst_differences(run, ref)}")
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:20])
    assert len(run.losses) == 2 and len(run.losses[0]) == 4
    if "--moe" in case.args:  # the routers' losses were tracked, every layer's on some rank
        assert all(bool((step["load_balancing_loss"] > 0).all()) for step in run.aux_losses), run.aux_losses
    depths = (int(case.args[case.args.index("--mtp") + 1]) if "--mtp" in case.args
              else sum(a.count("/") for a in case.args))
    if depths:  # each microbatch's loss of each depth was tracked
        assert all(len(mb) == depths and min(mb) > 0 for step in run.mtp_losses for mb in step), run.mtp_losses

    if "--pp" not in case.args:  # no pipeline: no P2P traffic to check
        assert all(not shapes for shapes in run.shapes.values()), run.shapes
        return
    # Shapes: every send of rank r has the width the next rank receives; n*C with mHC, C without.
    width = HIDDEN * N if case.mhc else HIDDEN
    for rank, shapes in run.shapes.items():
        assert shapes, f"rank {rank} recorded no P2P traffic"
        widths = {s[-1] for _, s in shapes}
        assert widths == {width}, f"rank {rank} P2P widths {sorted(widths)}, expected {width}"
    sends = sorted({s for r in run.shapes.values() for kind, s in r if kind.startswith("send")})
    recvs = sorted({s for r in run.shapes.values() for kind, s in r if kind.startswith("recv")})
    assert sends == recvs, f"sent shapes {sends} != received shapes {recvs}"


def test_crashed_rank_fails_with_its_stderr_and_leaves_nothing(reference_runs, tmp_path):
    """Rank 1 dies mid-run: the launch fails fast, names the failure, and no worker survives."""
    init = reference_runs["mhc"] / "init.pt"
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        run_worker(tmp_path, 2, ["--pp", "2", "--init", str(init), "--crash-rank", "1"], timeout=120)
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
