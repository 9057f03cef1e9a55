"""Checks and lanes: how actual metric series are compared with golden ones.

Checks are chosen by the recipe or the test, never stored in golden files. Three lanes:

* `ExactCheck` -- deterministic runs: every step equal (`np.isclose` with rtol=atol=0).
* `ApproximateCheck` -- `|actual - golden| <= atol + rtol * |golden|` per step; passes
  when at most `k = min(max(N // 100, 1), 50)` of the N golden steps miss (as upstream; a
  single-value series must match, k = 0).
* `TimingCheck` -- medians over a steady window, two-sided band: too slow fails, and
  much faster fails too, asking for a refresh of the golden values.

Exact and approximate lanes need the same steps on both sides; the timing lane needs the
window steps on both sides. Every failure lists step, actual, golden, delta and the band.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from harness.golden.schema import Golden, MetricSeries

__all__ = [
    "CHECK_THRESHOLDS",
    "ApproximateCheck",
    "Check",
    "CheckResult",
    "ExactCheck",
    "TimingCheck",
    "allowed_misses",
    "compare",
    "compare_metric",
    "format_results",
    "timing_window",
    "upstream_checks",
]

MAX_LISTED_STEPS = 10
"""Failing steps printed per check before '... and N more'."""

Status = Literal["pass", "fail", "refresh", "missing", "misaligned", "n/a"]
"""`n/a`: an exact check on a machine whose numerics fingerprint has no exact values (see
`harness.golden.case_check`); it neither passes nor fails, and another lane decides."""


def _nonneg(obj: object, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{type(obj).__name__}.{name}={v!r} must be a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class ExactCheck:
    """Deterministic lane: every step bit-equal to the golden value."""

    def describe(self) -> str:
        return "exact"


@dataclass(frozen=True, kw_only=True)
class ApproximateCheck:
    """Approximate lane: per-step `np.isclose(actual, golden, rtol, atol)`, a few misses allowed."""

    rtol: float = 0.0
    """Relative tolerance, against `|golden|`."""
    atol: float = 0.0
    """Absolute tolerance."""
    max_misses: int | None = None
    """Steps allowed to miss; None: upstream's `min(max(N // 100, 1), 50)`."""

    def __post_init__(self) -> None:
        _nonneg(self, "rtol", "atol")
        if self.max_misses is not None and (
            isinstance(self.max_misses, bool) or not isinstance(self.max_misses, int) or self.max_misses < 0
        ):
            raise ValueError(f"ApproximateCheck.max_misses={self.max_misses!r} must be None or an int >= 0")

    def describe(self) -> str:
        k = "" if self.max_misses is None else f" max_misses={self.max_misses}"
        return f"approx rtol={self.rtol:g} atol={self.atol:g}{k}"


@dataclass(frozen=True, kw_only=True)
class TimingCheck:
    """Timing lane: median over a steady window within `[-rel_band_fast, +rel_band_slow]` of golden.

    The window is `window` if given, else upstream's: steps 5..20 when the last golden step is
    <= 25, else 30..45. With fewer than `min_window_steps` golden steps in it, the first
    `min_window_steps` steps at or after its start are used (upstream main); if even those are
    too few, the second half of the series (skipping warm-up).
    """

    rel_band_slow: float = 0.05
    """Fail when slower than golden by more than this fraction."""
    rel_band_fast: float = 0.05
    """Fail (asking for a refresh) when faster than golden by more than this fraction."""
    window: tuple[int, int] | None = None
    """Inclusive `(first_step, last_step)`; None: upstream's rule."""
    higher_is_better: bool = False
    """True for throughput-like metrics (bytes/s): a higher value is faster."""
    min_window_steps: int = 4

    def __post_init__(self) -> None:
        _nonneg(self, "rel_band_slow", "rel_band_fast")
        if self.rel_band_fast >= 1 and not self.higher_is_better:
            raise ValueError(
                f"TimingCheck.rel_band_fast={self.rel_band_fast!r} must be < 1 for a time metric"
            )
        if self.window is not None:
            w = self.window
            if (
                not isinstance(w, tuple)
                or len(w) != 2
                or not all(isinstance(s, int) for s in w)
                or w[0] > w[1]
            ):
                raise ValueError(
                    f"TimingCheck.window={w!r} must be a tuple (first_step, last_step), first <= last"
                )
        if not isinstance(self.min_window_steps, int) or self.min_window_steps < 1:
            raise ValueError(f"TimingCheck.min_window_steps={self.min_window_steps!r} must be an int >= 1")

    def describe(self) -> str:
        return f"timing -{self.rel_band_fast:.0%}..+{self.rel_band_slow:.0%}"


Check = ExactCheck | ApproximateCheck | TimingCheck

CHECK_THRESHOLDS: dict[str, float] = {
    "lm loss": 0.05,
    "mtp_1 loss": 0.05,
    "mtp_2 loss": 0.05,
    "total loss": 0.05,
    "num-zeros": 0.20,
    "iteration-time": 0.05,
    "mem-allocated-bytes": 0.05,
    "mem-max-allocated-bytes": 0.05,
}
"""Upstream's approximate-lane rtol per metric (`CHECK_THRESHOLDS`)."""

_NO_EXACT = ("iteration-time", "mem-allocated-bytes", "mem-max-allocated-bytes")


def upstream_checks(
    metrics: Iterable[str] = ("lm loss", "num-zeros"), *, deterministic: bool = True
) -> dict[str, tuple[Check, ...]]:
    """Upstream's default checks for `metrics`: exact (when deterministic) plus approximate.

    `iteration-time` gets a `TimingCheck` with a 5% band both ways; `mem-*` only the
    approximate lane. Unknown names raise `ValueError`: choose their checks explicitly.
    """
    out: dict[str, tuple[Check, ...]] = {}
    for name in metrics:
        if name not in CHECK_THRESHOLDS:
            raise ValueError(
                f"metrics: no upstream threshold for {name!r}; known: {sorted(CHECK_THRESHOLDS)}"
            )
        rtol = CHECK_THRESHOLDS[name]
        if name == "iteration-time":
            out[name] = (TimingCheck(rel_band_slow=rtol, rel_band_fast=rtol),)
        elif name in _NO_EXACT or not deterministic:
            out[name] = (ApproximateCheck(rtol=rtol),)
        else:
            out[name] = (ExactCheck(), ApproximateCheck(rtol=rtol))
    return out


def allowed_misses(n_steps: int) -> int:
    """Upstream's tolerated misses for N steps: `min(max(N // 100, 1), 50)`; 0 for a single value."""
    return 0 if n_steps <= 1 else min(max(n_steps // 100, 1), 50)


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """The outcome of one check on one metric."""

    metric: str
    check: str
    """`describe()` of the check."""
    status: Status
    message: str
    """One headline plus detail lines (steps, actual, golden, delta, band)."""
    n_steps: int = 0
    n_misses: int = 0
    allowed: int = 0
    worst_step: int | None = None
    worst_delta: float | None = None
    """Signed `actual - golden` where `|relative delta|` is largest (timing: of the medians)."""
    worst_rel: float | None = None
    """Signed relative delta at that step (None when golden is 0)."""

    @property
    def ok(self) -> bool:
        """Passed, or not applicable here (`n/a`)."""
        return self.status in ("pass", "n/a")


def _fmt(v: float) -> str:
    return f"{v:.10g}"


def _rel(a: float, g: float) -> float | None:
    return (a - g) / abs(g) if g != 0 else None


def _worst(
    steps: Sequence[int], a: np.ndarray, g: np.ndarray
) -> tuple[int | None, float | None, float | None]:
    if not len(steps):
        return None, None, None
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(g != 0, np.abs(a - g) / np.abs(g), np.abs(a - g))
    score = np.where(np.isnan(score), np.inf, score)
    i = int(np.argmax(score))
    return steps[i], float(a[i] - g[i]), _rel(float(a[i]), float(g[i]))


def _step_line(step: int, a: float, g: float, band: str) -> str:
    rel = _rel(a, g)
    rel_s = f"{rel:+.3e}" if rel is not None else "n/a"
    return f"  step {step}: actual {_fmt(a)}, golden {_fmt(g)}, delta {a - g:+.4g} (rel {rel_s}), band {band}"


def _misaligned(
    metric: str, check: str, only_g: Iterable[int], only_a: Iterable[int], source: str
) -> CheckResult:
    only_g, only_a = sorted(only_g), sorted(only_a)
    msg = (
        f"{metric} [{check}]: steps misaligned with {source}: steps only in golden: {_steps_text(only_g)}; "
        f"steps only in actual: {_steps_text(only_a)}"
    )
    return CheckResult(metric=metric, check=check, status="misaligned", message=msg)


def _steps_text(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    head = ", ".join(map(str, steps[:20]))
    return head + (f", ... ({len(steps)} in all)" if len(steps) > 20 else "")


def timing_window(steps: Sequence[int], check: TimingCheck) -> tuple[list[int], str]:
    """The golden steps the timing lane takes the median over, and how they were chosen."""
    steps = sorted(steps)
    first, last = check.window or ((5, 20) if steps[-1] <= 25 else (30, 45))
    rule = (
        "given window"
        if check.window
        else f"upstream window (last step {steps[-1]} {'<=' if steps[-1] <= 25 else '>'} 25)"
    )
    sel = [s for s in steps if first <= s <= last]
    if len(sel) >= check.min_window_steps:
        return sel, f"steps {first}..{last}, {rule}"
    after = [s for s in steps if s >= first][: check.min_window_steps]
    if len(after) >= check.min_window_steps:
        return after, f"first {check.min_window_steps} steps from {first} (window {first}..{last} too sparse)"
    half = steps[len(steps) // 2 :]
    return half, f"second half of the series (too few steps for window {first}..{last})"


def _compare_timing(
    metric: str, a: MetricSeries, g: MetricSeries, check: TimingCheck, source: str
) -> CheckResult:
    name = check.describe()
    sel, how = timing_window(g.steps, check)
    missing = [s for s in sel if s not in a.values]
    if missing:
        return _misaligned(metric, name, missing, [], source)
    av = [a.values[s] for s in sel]
    bad = [s for s, v in zip(sel, av, strict=True) if not math.isfinite(v)]
    am, gm = statistics.median(av), statistics.median(g.values[s] for s in sel)
    head = f"{metric} [{name}]: median over {len(sel)} steps {sel[0]}..{sel[-1]} ({how})"
    lo_b, hi_b = (
        (check.rel_band_slow, check.rel_band_fast)
        if check.higher_is_better
        else (check.rel_band_fast, check.rel_band_slow)
    )
    band = f"-{lo_b:.2%}..+{hi_b:.2%} of golden"
    common = dict(
        metric=metric,
        check=name,
        n_steps=len(sel),
        worst_step=None,
        worst_delta=am - gm,
        worst_rel=_rel(am, gm),
    )
    if bad:
        return CheckResult(
            **common,
            status="fail",
            n_misses=len(bad),
            message=f"{head}: non-finite actual values at steps {_steps_text(bad)}",
        )
    if gm <= 0:
        return CheckResult(**common, status="fail", message=f"{head}: golden median {_fmt(gm)} must be > 0")
    detail = (
        f"{head}: actual {_fmt(am)}, golden {_fmt(gm)}, delta {am - gm:+.4g} "
        f"({(am - gm) / gm:+.2%}), band {band}"
    )
    hi, lo = (
        gm * (1 + (check.rel_band_fast if check.higher_is_better else check.rel_band_slow)),
        gm * (1 - (check.rel_band_slow if check.higher_is_better else check.rel_band_fast)),
    )
    slow = am < lo if check.higher_is_better else am > hi
    fast = am > hi if check.higher_is_better else am < lo
    if slow:
        return CheckResult(**common, status="fail", n_misses=1, message=f"{detail} -> too slow")
    if fast:
        return CheckResult(
            **common,
            status="refresh",
            n_misses=1,
            message=f"{detail} -> much faster than golden: refresh the golden values",
        )
    return CheckResult(**common, status="pass", message=f"{detail} -> ok")


def compare_metric(
    metric: str,
    actual: MetricSeries | None,
    golden: MetricSeries | None,
    check: Check,
    *,
    source: str = "golden",
) -> CheckResult:
    """Run one check on one metric; `source` names the golden file in messages."""
    name = check.describe()
    if golden is None or actual is None:
        side = f"golden file {source}" if golden is None else "the actual values"
        return CheckResult(
            metric=metric,
            check=name,
            status="missing",
            message=f"{metric} [{name}]: metric {metric!r} is missing from {side}",
        )
    if isinstance(check, TimingCheck):
        return _compare_timing(metric, actual, golden, check, source)
    if set(actual.steps) != set(golden.steps):
        return _misaligned(
            metric, name, set(golden.steps) - set(actual.steps), set(actual.steps) - set(golden.steps), source
        )
    steps = list(golden.steps)
    a = np.array([actual.values[s] for s in steps], dtype=np.float64)
    g = np.array([golden.values[s] for s in steps], dtype=np.float64)
    if isinstance(check, ExactCheck):
        rtol, atol, allowed = 0.0, 0.0, 0
        rule = "allowed 0"
    else:
        rtol, atol = check.rtol, check.atol
        allowed = allowed_misses(len(steps)) if check.max_misses is None else check.max_misses
        rule = f"allowed k={allowed}" + (" = min(max(N // 100, 1), 50)" if check.max_misses is None else "")
    close = np.isclose(a, g, rtol=rtol, atol=atol, equal_nan=False)
    miss = [i for i in range(len(steps)) if not close[i]]
    ws, wd, wr = _worst(steps, a, g)
    verb = "differ" if isinstance(check, ExactCheck) else "outside the band"
    head = f"{metric} [{name}]: {len(miss)} of {len(steps)} steps {verb}, {rule}"
    lines = []
    for i in miss[:MAX_LISTED_STEPS]:
        band = "delta == 0" if isinstance(check, ExactCheck) else f"|delta| <= {atol + rtol * abs(g[i]):.4g}"
        lines.append(_step_line(steps[i], float(a[i]), float(g[i]), band))
    if len(miss) > MAX_LISTED_STEPS:
        lines.append(f"  ... and {len(miss) - MAX_LISTED_STEPS} more steps")
    status: Status = "pass" if len(miss) <= allowed else "fail"
    return CheckResult(
        metric=metric,
        check=name,
        status=status,
        message="\n".join([head, *lines]),
        n_steps=len(steps),
        n_misses=len(miss),
        allowed=allowed,
        worst_step=ws,
        worst_delta=wd,
        worst_rel=wr,
    )


def compare(
    actual: Golden, golden: Golden, checks: Mapping[str, Check | Sequence[Check]], *, source: str = "golden"
) -> tuple[CheckResult, ...]:
    """Run every check on its metric, in the order of `checks`."""
    if not checks:
        raise ValueError("checks must name at least one metric (metric -> check or checks)")
    out = []
    for metric, chk in checks.items():
        for c in chk if isinstance(chk, Sequence) else (chk,):
            if not isinstance(c, ExactCheck | ApproximateCheck | TimingCheck):
                raise ValueError(
                    f"checks[{metric!r}]={c!r} is not an ExactCheck, ApproximateCheck or TimingCheck"
                )
            out.append(compare_metric(metric, actual.get(metric), golden.get(metric), c, source=source))
    return tuple(out)


def format_results(results: Iterable[CheckResult], *, only_failures: bool = True) -> str:
    """The messages of the (failing) results, one block each."""
    return "\n".join(r.message for r in results if not (only_failures and r.ok))
