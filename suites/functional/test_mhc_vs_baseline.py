"""The mHC case against its baseline (same data, seed and sizes): mHC is active, and what it costs."""

from __future__ import annotations

import math

import pytest

from harness.training.metrics import ITERATION_TIME, LM_LOSS, step_time_ratio
from suites.functional.session import STEP_TIME_RATIO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PAIRS = [("gpt_tp1_pp1", "gpt_tp1_pp1_mhc")]
"""(baseline, mHC) as the report pairs them: `X` with `X_mhc`."""


def _runs(functional_runs, base, mhc):
    for case in (base, mhc):
        reason = functional_runs.skip_reason(case)
        if reason:
            pytest.skip(reason)
    return functional_runs.run(base), functional_runs.run(mhc)


@pytest.mark.parametrize(("base", "mhc"), PAIRS, ids=[m for _, m in PAIRS])
def test_mhc_loss_curve_is_finite_and_differs_from_baseline(base, mhc, functional_runs):
    """Every mHC loss is finite, and the curve differs from the baseline's at most steps."""
    b, m = _runs(functional_runs, base, mhc)
    lb, lm = b.metrics[LM_LOSS], m.metrics[LM_LOSS]
    assert sorted(lb) == sorted(lm)
    bad = {s: v for s, v in lm.items() if not math.isfinite(v)}
    assert not bad, f"{mhc}: non-finite lm loss at steps {bad}"
    differ = [s for s in lm if lm[s] != lb[s]]
    gap = max(abs(lm[s] - lb[s]) for s in lm)
    assert len(differ) >= len(lm) - 1 and gap > 1e-3, (
        f"{mhc} vs {base}: lm loss differs at {len(differ)} of {len(lm)} steps, max |delta| {gap:.3e}; "
        "mHC looks inactive"
    )


@pytest.mark.parametrize(("base", "mhc"), PAIRS, ids=[m for _, m in PAIRS])
def test_mhc_step_time_ratio_is_reported(base, mhc, functional_runs, request, record_property):
    """The mHC / baseline step-time ratio is measured and reported (never asserted against a speed)."""
    b, m = _runs(functional_runs, base, mhc)
    ratio = step_time_ratio(m.metrics[ITERATION_TIME], b.metrics[ITERATION_TIME])
    record_property("mhc_step_time_ratio", ratio)
    request.config.stash.setdefault(STEP_TIME_RATIO, {})[f"{mhc} / {base}"] = ratio
    print(f"{mhc} / {base}: step-time ratio {ratio:.3f}")
    assert math.isfinite(ratio) and ratio > 0
