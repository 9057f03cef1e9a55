"""A Megatron-LM tree (`--megatron-lm TREE` / `$MHC_MEGATRON_LM`) trains the recipes beside ours.

The tree's model, schedules, DDP and optimizer train each `tree_diff.CASES` recipe from the initial
weights our model writes; every step of lm loss, grad norm and num-zeros must be inside the bands of our
run of the same recipe (same weights, same data), and the tree's own ckpt-resume must reproduce its
uninterrupted steps. Without a tree every test here skips, saying so.
"""

from __future__ import annotations

import pytest

from harness.golden.compare import compare, format_results
from harness.golden.schema import to_golden
from harness.upstream.tree_report import TreeRow
from suites.functional import tree_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("case", tree_diff.CASES)
def test_tree_training_matches_ours(case, megatron_lm_tree, hw_key, tmp_path, tree_rows):
    """The tree's training of `case` equals ours step by step within the bands; then its ckpt-resume."""
    tree = megatron_lm_tree
    reason = tree_diff.skip_reason(case, hw_key, tree.flavor)
    if reason:
        pytest.skip(f"{tree.label}: {reason}")
    data = tmp_path / "data"
    init = tmp_path / "init" / "init.pt"
    ours = tree_diff.run_ours(
        case, hw_key, tree.flavor, init, work_dir=tmp_path / "ours", data_dir=data, write_init=True
    )
    ckpt = tmp_path / "tree-checkpoints"
    theirs = tree_diff.run_tree(
        case, hw_key, tree, init, work_dir=tmp_path / "tree", data_dir=data, save=ckpt
    )
    rows = tree_diff.differences(ours.metrics, theirs.metrics, bands=tree_diff.bands_for(case, hw_key))
    report = f"ours vs {tree.label} on {case} ({theirs.seconds:.0f} s for the tree):\n" + tree_diff.describe(
        rows
    )
    print(report)
    ok = all(r.outside == 0 and not r.only_a and not r.only_b for r in rows)
    tree_rows(
        TreeRow(
            suite="functional",
            case=case,
            comparison="tree vs ours",
            tree=tree.label,
            worst=tree_diff.worst(rows),
            ok=ok,
            note=f"tree {theirs.seconds:.0f} s, ours {ours.seconds:.0f} s",
        )
    )
    tree_rows(tree_diff.retention_row(case, tree.label, theirs.out_dir))
    assert ok, report

    from harness.training.checkpoint import rewind_tracker

    half = theirs.plan.args.save_interval
    if half is None:
        return
    rewind_tracker(ckpt, half)
    resumed = tree_diff.run_tree(
        case, hw_key, tree, init, work_dir=tmp_path / "tree-resumed", data_dir=data, load=ckpt
    )
    checks = tree_diff.functional_checks(case, hw_key)
    tail = {m: {s: v for s, v in theirs.metrics[m].items() if s > half} for m in checks}
    results = compare(
        to_golden(resumed.metrics), to_golden(tail), checks, source=f"{tree.label} uninterrupted"
    )
    tree_rows(
        TreeRow(
            suite="functional",
            case=case,
            comparison="tree resumed vs uninterrupted",
            tree=tree.label,
            worst={m: max(abs(r.worst_rel or 0.0) for r in results if r.metric == m) for m in checks},
            ok=all(r.ok for r in results),
            note=f"from step {half}",
        )
    )
    assert all(r.ok for r in results), f"{tree.label}: resumed from step {half} differs:\n" + format_results(
        results
    )


def test_tree_run_that_raises_names_the_tree(megatron_lm_tree, hw_key, tmp_path):
    """A tree run whose rank raises fails with a LaunchError naming the tree, the case and the rank's error."""
    tree = megatron_lm_tree
    from harness.launch.runs import CRASH_RANK_ENV_VAR
    from harness.launch.torchrun import LaunchError

    case = tree_diff.CASES[1]  # one rank: every tree can train it
    init = tree_diff.dump_init(
        case, hw_key, tree.flavor, work_dir=tmp_path / "init", data_dir=tmp_path / "data"
    )
    with pytest.raises(LaunchError) as err:
        tree_diff.run_tree(
            case,
            hw_key,
            tree,
            init,
            work_dir=tmp_path / "tree",
            data_dir=tmp_path / "data",
            env={CRASH_RANK_ENV_VAR: "0"},
        )
    text = str(err.value)
    assert tree.label in text and case in text and "crash planted" in text, text[-2000:]
