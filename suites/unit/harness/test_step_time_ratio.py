"""The report's mHC / baseline step-time ratio."""

from __future__ import annotations

import pytest

from harness.golden.schema import MetricSeries
from harness.report import step_time_ratios


def _series(values: list[float]) -> MetricSeries:
    return MetricSeries(
        start_step=1, end_step=len(values), step_interval=1, values={i + 1: v for i, v in enumerate(values)}
    )


def test_ratio_of_medians_after_warmup():
    """Pairs X with X_mhc and divides the medians of iteration-time after the warm-up steps."""
    actuals = {
        "functional": {
            "gpt": {"iteration-time": _series([9.0, 9.0, 9.0, 1.0, 1.0, 2.0])},
            "gpt_mhc": {"iteration-time": _series([9.0, 9.0, 9.0, 2.0, 3.0, 3.0])},
            "other_mhc": {"iteration-time": _series([1.0])},
        }
    }
    [(suite, base, mhc, tb, tm, ratio)] = step_time_ratios(actuals)
    assert (suite, base, mhc) == ("functional", "gpt", "gpt_mhc")
    assert (tb, tm) == (1.0, 3.0)
    assert ratio == pytest.approx(3.0)


def test_pairs_without_timing_are_skipped():
    """A pair where one side has no iteration-time gives no row."""
    actuals = {"s": {"a": {"lm loss": _series([1.0])}, "a_mhc": {"iteration-time": _series([1.0])}}}
    assert step_time_ratios(actuals) == []
