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
