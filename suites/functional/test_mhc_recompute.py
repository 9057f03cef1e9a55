"""mHC recompute in a real training run: the same losses, grad norms and zero counts, bit for bit."""

from __future__ import annotations

import pytest

from harness.golden.compare import ExactCheck, compare, format_results
from harness.golden.schema import to_golden
from harness.training.metrics import GRAD_NORM, LM_LOSS, NUM_ZEROS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp1_pp1_mhc"
RECOMPUTE = {"--recompute-granularity": "selective", "--recompute-modules": "[mhc]"}
"""Upstream's spelling of the flags (the functional recipe of Megatron-LM PR #4948)."""


def test_mhc_recompute_run_equals_the_plain_run(functional_runs):
    """With `--recompute-modules [mhc]` lm loss, grad norm and num-zeros equal the plain mHC run at every step."""
    plain = functional_runs.deterministic_run(CASE)
    recomputed = functional_runs.fresh(CASE, "mhc-recompute", overrides=RECOMPUTE)
    assert recomputed.plan.args.recompute_modules == ("mhc",)
    names = (LM_LOSS, GRAD_NORM, NUM_ZEROS)
    results = compare(
        to_golden({n: recomputed.metrics[n] for n in names}),
        to_golden({n: plain.metrics[n] for n in names}),
        {n: ExactCheck() for n in names},
        source=f"plain run of {CASE}",
    )
    assert all(r.ok for r in results), format_results(results)


SINGLE_PASS = "hybrid_tp1_pp2_mhc_moe_v41"
FULL = {
    "--recompute-granularity": "full",
    "--recompute-modules": None,
    "--recompute-method": "uniform",
    "--recompute-num-layers": 1,
}
"""Megatron-core's full recompute instead of the recipe's mHC recompute (allowed in the single-pass form)."""


def test_full_recompute_of_the_single_pass_recipe_equals_its_mhc_recompute_run(functional_runs):
    """DeepSeek-V4.1's recipe (hybrid MoE over two stages, the carrier through megatron's checkpointed layers)
    under full recompute: lm loss, grad norm and num-zeros at every step bitwise the recipe's own run (mHC
    recompute); its launch kept nothing of a step (the retention check passes on every rank)."""
    plain = functional_runs.deterministic_run(SINGLE_PASS)
    full = functional_runs.fresh(SINGLE_PASS, "full-recompute", overrides=FULL)
    assert (full.plan.args.recompute_granularity, full.plan.args.recompute_modules) == ("full", None)
    assert plain.plan.args.recompute_modules == ("mhc",)
    names = (LM_LOSS, GRAD_NORM, NUM_ZEROS)
    results = compare(
        to_golden({n: full.metrics[n] for n in names}),
        to_golden({n: plain.metrics[n] for n in names}),
        {n: ExactCheck() for n in names},
        source=f"the mHC-recompute run of {SINGLE_PASS}",
    )
    assert all(r.ok for r in results), format_results(results)
    assert len(sorted(full.out_dir.glob("retention-rank*.json"))) == full.plan.nproc
