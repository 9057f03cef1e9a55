"""ckpt-resume cases: a second launch from the checkpoint at N/2 reproduces the uninterrupted run."""

from __future__ import annotations

import pytest

from harness.golden.compare import ExactCheck, compare, format_results
from harness.golden.schema import to_golden
from harness.training.recipe import RECIPE_DIR, load_recipe, recipe_names

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RESUME_CASES = [c for c in recipe_names() if load_recipe(RECIPE_DIR / f"{c}.yaml").test_type == "ckpt-resume"]


@pytest.mark.parametrize("case", RESUME_CASES)
def test_resumed_steps_equal_uninterrupted_run(case, functional_runs):
    """Steps N/2+1..N of the resumed launch equal the uninterrupted run (exactly where deterministic)."""
    reason = functional_runs.skip_reason(case)
    if reason:
        pytest.skip(reason)
    full, resumed = functional_runs.run(case), functional_runs.resumed(case)
    half = full.plan.args.save_interval
    assert sorted(resumed.metrics["lm loss"]) == list(range(half + 1, full.plan.args.train_iters + 1))
    checks = functional_runs.recipe(case).checks(functional_runs.hw)
    checks = {m: c for m, c in checks.items() if m in ("lm loss", "num-zeros", "grad-norm")}
    assert checks, f"{case}: its recipe checks none of lm loss, num-zeros, grad-norm on {functional_runs.hw}"
    if full.plan.deterministic:
        assert all(any(isinstance(x, ExactCheck) for x in c) for c in checks.values()), checks
    tail = {m: {s: v for s, v in full.metrics[m].items() if s > half} for m in checks}
    results = compare(to_golden(resumed.metrics), to_golden(tail), checks, source=f"{case} uninterrupted run")
    assert all(r.ok for r in results), f"{case}: resumed from step {half} differs:\n" + format_results(
        results
    )
