"""Every recipe that runs on this hardware reproduces its golden values (the recipe's checks)."""

from __future__ import annotations

import pytest

from harness.training.recipe import recipe_names

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c, marks=pytest.mark.golden_case(c)) for c in recipe_names()]
)
def test_golden_case(case, functional_runs, golden_metrics):
    """A fresh run of the case matches golden/<hw>/functional/<case>.json under the recipe's checks."""
    reason = functional_runs.skip_reason(case)
    if reason:
        pytest.skip(reason)
    run = functional_runs.run(case)
    golden_metrics.check(
        case,
        run.metrics,
        functional_runs.recipe(case).checks(functional_runs.hw),
        fingerprint=run.fingerprint,
    )
