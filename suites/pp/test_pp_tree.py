"""A Megatron-LM source tree (`--megatron-lm TREE` / `$MHC_MEGATRON_LM`) under the pp suite, beside ours.

The tree's own GPT (its config, spec builder, `GPTModel`) and its own schedules run the cases of
`test_pp_runs.py`; each must reproduce the tree's single-process run (every microbatch loss, gradient
and updated weight), with the P2P shapes its `get_tensor_shapes` returns equal to the n-stream rule's,
and match our integration on the same case from the same weights (state dict mapped by name) and
microbatches. dev is trained against `--numerics dev` (the `megatron_dev` variant with the learned
block exit); main, which has no spec wiring and no n-stream schedules (`tree_model.MAIN_*_NOTE`), runs
single-process against our `megatron_main`. Without a tree every test here skips, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.launch.torchrun import LaunchError
from harness.upstream.tree_model import MAIN_PP_NOTE, MAIN_SPEC_NOTE
from harness.upstream.tree_report import TreeRow
from mhc_core.megatron.config import MHCTransformerConfig
from mhc_core.megatron.pipeline import get_tensor_shapes
from suites.pp.compare_runs import compare_to_reference, load_run, unsharded, worst_differences
from suites.pp.conftest import TreeRuns
from suites.pp.launch import run_worker
from suites.pp.pp_worker import MODEL
from suites.pp.test_pp_shapes import Group

pytestmark = pytest.mark.distributed

TREE_VS_OURS_RTOL = 2e-5
"""Tree against ours (other megatron-core, other torch build, same math): fp32 reordering in the mHC
mapping and the learned exit; measured 5.2e-6 worst (an hc_head_fn gradient), losses 1.2e-7."""


@dataclass(frozen=True, kw_only=True)
class TreeCase:
    """One pipelined run of the tree: ranks, worker flags, the tolerance against its single process."""

    name: str
    nproc: int
    args: tuple[str, ...]
    rtol: float = 1e-6
    vpp: bool = False
    model: str = "dense"
    """The tree's single-process run it must reproduce (`TreeRuns.FLAGS`): `dense`, `moe`, `mtp`, `hybrid` or
    `hybrid-mtp`."""


CASES = [
    TreeCase(name="pp2", nproc=2, args=("--pp", "2")),
    TreeCase(name="pp4", nproc=4, args=("--pp", "4")),
    TreeCase(name="pp2-vpp2", nproc=2, args=("--pp", "2", "--vpp", "2"), vpp=True),
    TreeCase(
        name="pp2-embedding-loss-stages", nproc=2, args=("--pp", "2", "--embedding-stage", "--loss-stage")
    ),
    # TP splits every matmul's reduction; dev's learned block exit has a small, cancellation-dominated
    # gradient (hc_head_fn, |g| ~1e-5): measured 5.6e-6 against the tree's single process.
    TreeCase(name="tp2-pp2", nproc=4, args=("--tp", "2", "--pp", "2"), rtol=2e-5),
    # MoE MLPs (4 local experts, top-2, alltoall) and two MTP depths, as in test_pp_runs.py (same bounds: EP's data
    # parallelism and the MTP stage's embedding-gradient sum reorder fp32 sums).
    TreeCase(name="pp2-moe", nproc=2, args=("--pp", "2", "--moe", "alltoall"), model="moe"),
    # EP 2's data parallelism reorders the microbatch sums; dev's learned-exit gradient hc_head_fn (|g| ~1e-5,
    # cancellation-dominated) moves most: measured 1.3e-5 against the tree's single process.
    TreeCase(name="ep2-moe", nproc=2, args=("--ep", "2", "--moe", "alltoall"), model="moe", rtol=2e-5),
    TreeCase(
        name="tp2-pp2-sp-moe",
        nproc=4,
        args=("--tp", "2", "--pp", "2", "--sp", "--moe", "alltoall"),
        model="moe",
        rtol=2e-5,
    ),
    TreeCase(name="pp2-mtp", nproc=2, args=("--pp", "2", "--mtp", "2"), model="mtp", rtol=1e-5),
    TreeCase(
        name="pp2-vpp2-mtp",
        nproc=2,
        args=("--pp", "2", "--vpp", "2", "--mtp", "2"),
        model="mtp",
        rtol=1e-5,
        vpp=True,
    ),
    TreeCase(
        name="pp4-mtp-loss-stage",
        nproc=4,
        args=("--pp", "4", "--mtp", "2", "--layout", "Et|tt|t|mmL"),
        model="mtp",
        rtol=1e-5,
    ),
    # The tree's HybridModel (a local spec of its own classes) split at the pattern's `|`.
    TreeCase(name="pp2-hybrid", nproc=2, args=("--pp", "2", "--hybrid", "*-|*E"), model="hybrid"),
    TreeCase(name="pp4-hybrid", nproc=4, args=("--pp", "4", "--hybrid", "*|-|*|E"), model="hybrid"),
    TreeCase(
        name="pp2-vpp2-hybrid",
        nproc=2,
        args=("--pp", "2", "--vpp", "2", "--hybrid", "*|-|*|E"),
        model="hybrid",
        vpp=True,
    ),
    TreeCase(name="ep2-hybrid", nproc=2, args=("--ep", "2", "--hybrid", "*-*E"), model="hybrid", rtol=2e-5),
    # An MTP depth of the pattern (`/`) on the last stage (the per-stream h_proj: harness.upstream.tree_model).
    TreeCase(
        name="pp2-hybrid-mtp",
        nproc=2,
        args=("--pp", "2", "--hybrid", "*-|*E/*E"),
        model="hybrid-mtp",
        rtol=1e-5,
    ),
]


def _numerics(tree) -> list[str]:
    return ["--numerics", tree.flavor]


def _launch_tree(tree, out: Path, nproc: int, args: list[str]):
    """The tree's worker; a configuration the tree refuses skips the test with the tree's message."""
    try:
        return run_worker(out, nproc, ["--impl", "tree", "--flavor", tree.flavor, *args], tree=tree.path)
    except LaunchError:
        refusals = sorted(out.glob("refusal-rank*.txt"))
        if refusals:  # the rank wrote the tree's message and exited with REFUSED
            pytest.skip(
                f"refused by the tree ({tree.label}): {refusals[0].read_text(encoding='utf-8').strip()}"
            )
        raise


def _reference(tree_runs, model: str, case: str, tree_rows) -> Path:
    """The tree's single-process run of `model`; a tree that raises in it is a finding: the row names the case and
    the tree's error, and the test fails with it (the other cases still run)."""
    try:
        return tree_runs.reference(model)
    except LaunchError as exc:
        tree_rows(
            TreeRow(
                suite="pp",
                case=case,
                comparison="tree vs its single process",
                tree=tree_runs.tree.label,
                ok=False,
                note=f"the tree's single process ({model}) raised: {_first_error(exc)}",
            )
        )
        pytest.fail(
            f"the tree ({tree_runs.tree.label}) raised in its single-process {model} run: "
            f"{_first_error(exc)}",
            pytrace=False,
        )


def _first_error(exc: LaunchError) -> str:
    """The first `[rankN]: SomethingError: message` line of a failed launch with the frame that raised it (the
    last `File ..., line ..., in ...` before it), else the message's first line."""
    lines = [line.strip() for line in str(exc).splitlines()]
    for i, line in enumerate(lines):
        if "Error:" in line or "Exception:" in line:
            frames = [f.split("]: ", 1)[-1].strip() for f in lines[:i]]
            frames = [f for f in frames if f.startswith("File ")]
            where = f" (at {frames[-1]})" if frames else ""
            return line + where
    return lines[0]


@pytest.mark.parametrize("model", list(TreeRuns.FLAGS))
def test_tree_single_process_matches_ours(model, tree_runs, tmp_path, tree_report, tree_rows):
    """Our integration, from the tree's initial weights and on its microbatches, reproduces the tree's
    single-process losses (lm, MTP per depth), router losses, gradients and updated weights."""
    tree = tree_runs.tree
    case = f"single-process-{model}"
    ref = _reference(tree_runs, model, case, tree_rows)
    run_worker(tmp_path, 1, [*TreeRuns.FLAGS[model], *_numerics(tree), "--init", str(ref / "init.pt")])
    theirs, ours = load_run(ref), load_run(tmp_path)
    worst = worst_differences(ours, theirs)
    tree_report.add(case, None, worst)
    problems = compare_to_reference(ours, theirs, TREE_VS_OURS_RTOL)
    tree_rows(
        TreeRow(
            suite="pp",
            case=case,
            comparison="tree vs ours",
            tree=tree.label,
            worst=worst,
            ok=not problems,
            note=f"bound {TREE_VS_OURS_RTOL:g}",
        )
    )
    assert not problems, (
        f"ours vs the tree ({tree.label}): {len(problems)} mismatches, first "
        f"{problems[0]}\n" + "\n".join(problems[1:20])
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tree_pipelined_run(case, tree_runs, tmp_path, tree_report, tree_rows):
    """The tree's own PP run reproduces the tree's single process; its P2P shapes are the rule's; and our
    integration's run of the same case from the same weights matches it."""
    tree = tree_runs.tree
    if tree.flavor == "main":
        tree_rows(
            TreeRow(
                suite="pp", case=case.name, comparison="not run", tree=tree.label, ok=True, note=MAIN_PP_NOTE
            )
        )
        pytest.skip(f"{tree.label}: {MAIN_PP_NOTE}; {MAIN_SPEC_NOTE}")
    ref = _reference(tree_runs, case.model, case.name, tree_rows)
    init = ["--init", str(ref / "init.pt")]
    _launch_tree(tree, tmp_path / "tree", case.nproc, [*case.args, *init])
    single, run = load_run(ref), load_run(tmp_path / "tree")
    vs_single = worst_differences(run, single)
    problems = compare_to_reference(run, single, case.rtol)
    tree_rows(
        TreeRow(
            suite="pp",
            case=case.name,
            comparison="tree vs its single process",
            tree=tree.label,
            worst=vs_single,
            ok=not problems,
            note=f"bound {case.rtol:g}",
        )
    )
    assert not problems, (
        f"the tree ({tree.label}) under {case.name} vs its single process: {len(problems)} "
        "mismatches:\n" + "\n".join(problems[:20])
    )
    if "--pp" in case.args:  # no pipeline, no P2P hop to check
        _check_shapes(case, tmp_path / "tree")

    run_worker(tmp_path / "ours", case.nproc, [*case.args, *_numerics(tree), *init])
    ours, whole = load_run(tmp_path / "ours"), unsharded(run)
    vs_ours = worst_differences(ours, whole)
    tree_report.add(case.name, vs_single, vs_ours)
    problems = compare_to_reference(ours, whole, TREE_VS_OURS_RTOL)
    tree_rows(
        TreeRow(
            suite="pp",
            case=case.name,
            comparison="tree vs ours",
            tree=tree.label,
            worst=vs_ours,
            ok=not problems,
            note=f"bound {TREE_VS_OURS_RTOL:g}",
        )
    )
    assert not problems, (
        f"ours vs the tree ({tree.label}) under {case.name}: {len(problems)} mismatches, first "
        f"{problems[0]}\n" + "\n".join(problems[1:20])
    )


def _check_shapes(case: TreeCase, out: Path) -> None:
    """Every P2P transfer is n*C wide; the tree's 1F1B `get_tensor_shapes` equals the rule's for each rank."""
    records = [torch.load(f) for f in sorted(out.glob("rank*.pt"))]
    width = MODEL["hidden_size"] * MODEL["n"]
    for r in records:
        widths = {s[-1] for _, s in r["shapes"]}
        assert widths == {width}, f"rank {r['rank']} P2P widths {sorted(widths)}, expected {width}"
    calls = [c for r in records for c in r["tensor_shape_calls"]]
    if case.vpp:
        assert not calls, "the interleaved schedule sized its hops through get_tensor_shapes"
        return
    assert calls, "the tree's 1F1B never called get_tensor_shapes"
    for c in calls:
        config = MHCTransformerConfig(
            num_layers=MODEL["num_layers"],
            hidden_size=MODEL["hidden_size"],
            num_attention_heads=MODEL["num_attention_heads"],
            use_cpu_initialization=True,
            pipeline_dtype=torch.float32,
            tensor_model_parallel_size=c["tp_size"],
            pipeline_model_parallel_size=c["pp_size"],
            sequence_parallel=c["sequence_parallel"],
            enable_mhc_connections=True,
            mhc_num_residual_streams=MODEL["n"],
        )
        rule = get_tensor_shapes(
            seq_length=c["seq_length"],
            micro_batch_size=c["micro_batch_size"],
            decoder_seq_length=None,
            config=config,
            tp_group=Group(0, c["tp_size"]),
            cp_group=Group(0, c["cp_size"]),
            pp_group=Group(c["pp_rank"], c["pp_size"]),
            is_recv=c["is_recv"],
        )
        assert [tuple(s) for s in rule] == c["shapes"], (
            f"pp rank {c['pp_rank']}/{c['pp_size']} {'recv' if c['is_recv'] else 'send'}: the tree's "
            f"get_tensor_shapes {c['shapes']}, the rule {rule}"
        )
