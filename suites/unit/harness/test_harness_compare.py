"""Comparison lanes at their boundaries: exact, approximate (k misses), two-sided timing band."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.golden.compare import (
    ApproximateCheck,
    ExactCheck,
    TimingCheck,
    allowed_misses,
    compare,
    compare_metric,
    timing_window,
    upstream_checks,
)
from harness.golden.schema import MetricSeries, series_from_list

UP = math.inf
DOWN = -math.inf


def _pair(golden: list[float], actual: list[float]) -> tuple[MetricSeries, MetricSeries]:
    return series_from_list(actual), series_from_list(golden)


def _approx(n: int, misses: int, **kw):
    g = [10.0] * n
    a = [10.0] * n
    for i in range(misses):
        a[i] = 20.0
    return compare_metric("lm loss", *_pair(g, a), ApproximateCheck(rtol=0.05, **kw))


class TestExact:
    def test_equal_passes(self):
        """Identical series pass the exact lane."""
        assert compare_metric("m", *_pair([1.0, 2.0], [1.0, 2.0]), ExactCheck()).ok

    def test_one_ulp_fails_with_numbers(self):
        """One ulp off fails and the message gives step, actual, golden, delta and band."""
        a = np.nextafter(2.0, UP)
        r = compare_metric("lm loss", *_pair([1.0, 2.0], [1.0, a]), ExactCheck())
        assert "fail" == r.status
        assert "1 of 2 steps differ, allowed 0" in r.message
        assert f"step 2: actual {a:.10g}, golden 2, delta +4.441e-16" in r.message
        assert "band delta == 0" in r.message


class TestApproximateMisses:
    @pytest.mark.parametrize(
        ("n", "k"),
        [
            pytest.param(n, k, id=f"N{n}-k{k}")
            for n, k in [(1, 0), (50, 1), (199, 1), (250, 2), (5000, 50), (10000, 50)]
        ],
    )
    def test_allowed_misses(self, n, k):
        """k = min(max(N // 100, 1), 50), and 0 for a single value."""
        assert k == allowed_misses(n)

    def test_n50_one_miss_passes(self):
        """N=50: one step outside the band is tolerated."""
        r = _approx(50, 1)
        assert r.ok and "allowed k=1" in r.message

    def test_n50_two_misses_fail(self):
        """N=50: two steps outside the band fail."""
        r = _approx(50, 2)
        assert "fail" == r.status and "2 of 50 steps outside the band, allowed k=1" in r.message

    def test_n250_two_pass_three_fail(self):
        """N=250: k=2."""
        assert _approx(250, 2).ok
        assert not _approx(250, 3).ok

    def test_n10000_cap_at_50(self):
        """N=10000: k is capped at 50."""
        assert _approx(10000, 50).ok
        assert not _approx(10000, 51).ok

    def test_max_misses_override(self):
        """An explicit max_misses replaces the upstream rule."""
        assert not _approx(50, 1, max_misses=0).ok


class TestApproximateBand:
    def test_exactly_at_rtol_passes(self):
        """|actual - golden| == rtol * |golden| passes (dyadic numbers, no rounding)."""
        assert compare_metric("m", *_pair([8.0], [10.0]), ApproximateCheck(rtol=0.25)).ok

    def test_just_outside_rtol_fails(self):
        """One ulp beyond rtol fails and prints the band."""
        r = compare_metric("m", *_pair([8.0], [np.nextafter(10.0, UP)]), ApproximateCheck(rtol=0.25))
        assert "fail" == r.status and "band |delta| <= 2" in r.message

    def test_below_golden_symmetric(self):
        """The band is symmetric: golden * (1 - rtol) passes, one ulp lower fails."""
        chk = ApproximateCheck(rtol=0.25)
        assert compare_metric("m", *_pair([8.0], [6.0]), chk).ok
        assert not compare_metric("m", *_pair([8.0], [np.nextafter(6.0, DOWN)]), chk).ok

    def test_atol_boundary(self):
        """With golden 0, atol alone decides: equal passes, one ulp more fails."""
        chk = ApproximateCheck(atol=0.5)
        assert compare_metric("m", *_pair([0.0], [0.5]), chk).ok
        assert not compare_metric("m", *_pair([0.0], [np.nextafter(0.5, UP)]), chk).ok

    def test_nan_actual_misses(self):
        """A NaN actual value is a miss, never close."""
        assert not compare_metric("m", *_pair([1.0], [math.nan]), ApproximateCheck(rtol=1.0)).ok


def _timing(actual: float, **kw):
    g = [8.0] * 50
    return compare_metric(
        "iteration-time", *_pair(g, [actual] * 50), TimingCheck(rel_band_slow=0.25, rel_band_fast=0.25, **kw)
    )


class TestTimingBand:
    def test_at_slow_edge_passes(self):
        """A median exactly golden * (1 + slow) passes."""
        assert _timing(10.0).ok

    def test_beyond_slow_fails(self):
        """One ulp slower than the edge fails as too slow with measured, golden, delta and band."""
        r = _timing(np.nextafter(10.0, UP))
        assert "fail" == r.status
        assert "too slow" in r.message and "golden 8" in r.message and "band -25.00%..+25.00%" in r.message

    def test_at_fast_edge_passes(self):
        """A median exactly golden * (1 - fast) passes."""
        assert _timing(6.0).ok

    def test_beyond_fast_asks_refresh(self):
        """One ulp faster than the edge fails with status refresh and a refresh message."""
        r = _timing(np.nextafter(6.0, DOWN))
        assert "refresh" == r.status and "refresh the golden values" in r.message

    def test_throughput_direction(self):
        """higher_is_better flips the band: a lower throughput is too slow."""
        assert "fail" == _timing(5.0, higher_is_better=True).status
        assert "refresh" == _timing(11.0, higher_is_better=True).status

    def test_median_ignores_warmup_outside_window(self):
        """A slow warm-up step outside the window does not move the verdict."""
        a = [8.0] * 50
        a[0] = 100.0
        assert compare_metric("t", *_pair([8.0] * 50, a), TimingCheck()).ok

    def test_nonfinite_actual_fails(self):
        """A NaN inside the window fails instead of slipping through the median."""
        a = [8.0] * 50
        a[35] = math.nan
        r = compare_metric("t", *_pair([8.0] * 50, a), TimingCheck())
        assert "fail" == r.status and "non-finite actual values at steps 36" in r.message


class TestTimingWindow:
    def test_short_run_window(self):
        """Last golden step <= 25: steps 5..20."""
        sel, _ = timing_window(range(1, 26), TimingCheck())
        assert list(range(5, 21)) == sel

    def test_long_run_window(self):
        """Last golden step > 25: steps 30..45."""
        sel, _ = timing_window(range(1, 51), TimingCheck())
        assert list(range(30, 46)) == sel

    def test_sparse_window_takes_first_four_after_start(self):
        """Too few steps inside the window: the first four at or after its start (upstream main)."""
        sel, how = timing_window([1, 10, 20, 30, 40, 50, 60], TimingCheck())
        assert [30, 40, 50, 60] == sel and "first 4 steps from 30" in how

    def test_short_series_second_half(self):
        """A series shorter than the window uses its second half."""
        sel, how = timing_window([1, 2, 3], TimingCheck())
        assert [2, 3] == sel and "second half" in how

    def test_explicit_window(self):
        """An explicit window is used as given."""
        sel, _ = timing_window(range(1, 51), TimingCheck(window=(10, 13)))
        assert [10, 11, 12, 13] == sel


class TestChecksConfig:
    def test_upstream_thresholds(self):
        """lm loss gets exact + rtol 0.05, num-zeros rtol 0.20, iteration-time a 5% timing band."""
        c = upstream_checks(["lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"])
        assert (ExactCheck(), ApproximateCheck(rtol=0.05)) == c["lm loss"]
        assert (ExactCheck(), ApproximateCheck(rtol=0.20)) == c["num-zeros"]
        assert (TimingCheck(rel_band_slow=0.05, rel_band_fast=0.05),) == c["iteration-time"]
        assert (ApproximateCheck(rtol=0.05),) == c["mem-allocated-bytes"]

    def test_nondeterministic_drops_exact(self):
        """Without determinism only the approximate lane runs."""
        assert (ApproximateCheck(rtol=0.05),) == upstream_checks(["lm loss"], deterministic=False)["lm loss"]

    def test_unknown_metric_needs_explicit_check(self):
        """No silent default for an unknown metric name."""
        with pytest.raises(ValueError, match="no upstream threshold for 'grad norm'"):
            upstream_checks(["grad norm"])

    def test_negative_rtol_names_field(self):
        """A negative tolerance raises ValueError naming the field."""
        with pytest.raises(ValueError, match=r"ApproximateCheck\.rtol=-0\.1"):
            ApproximateCheck(rtol=-0.1)

    def test_bad_window_names_field(self):
        """A reversed window raises ValueError naming the field."""
        with pytest.raises(ValueError, match=r"TimingCheck\.window=\(5, 1\)"):
            TimingCheck(window=(5, 1))

    def test_checks_are_keyword_only(self):
        """Checks take keyword arguments only."""
        with pytest.raises(TypeError):
            ApproximateCheck(0.05)  # type: ignore[call-arg]  # positional: the refusal is the test

    def test_compare_rejects_non_check(self):
        """A tolerance that is not a check object is refused, naming the metric."""
        g = {"m": series_from_list([1.0])}
        with pytest.raises(ValueError, match=r"checks\['m'\]=0\.05"):
            compare(g, g, {"m": 0.05})
