"""A CPU case is bitwise reproducible: two launches give identical metrics (the exact lane holds)."""

from __future__ import annotations

import pytest

from harness.golden.compare import ExactCheck, compare, format_results
from harness.golden.schema import to_golden
from harness.training.metrics import GRAD_NORM, LM_LOSS, NUM_ZEROS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp1_pp1_mhc"


def test_second_launch_is_bitwise_identical(functional_runs):
    """A second launch of the mHC case reproduces lm loss, grad norm and num-zeros bit for bit."""
    first = functional_runs.deterministic_run(CASE)
    second = functional_runs.fresh(CASE, "second")
    names = (LM_LOSS, GRAD_NORM, NUM_ZEROS)
    results = compare(
        to_golden({n: second.metrics[n] for n in names}),
        to_golden({n: first.metrics[n] for n in names}),
        {n: ExactCheck() for n in names},
        source=f"first launch of {CASE}",
    )
    assert all(r.ok for r in results), format_results(results)
