"""Default approximate bands per metric, and how far two sets of series are apart under them.

`DEFAULT_BANDS` are the approximate lane's bands for deterministic training metrics. They
come from measured spread, not from guesses: the same cases run under different CPU numerics
profiles (ATen / MKL / oneDNN ISA caps) and on two x86-64 models (`docs/functional.md`,
"Bands"; the runs are in `docs/measurements/cpu-numerics-drift/`). Each band holds the largest
drift seen with a wide margin and still fails a real change: a 1e-3 relative lm-loss shift at
one step, another mHC variant, a learning-rate schedule one step longer in warm-up. Counts get an
absolute part, so that a count of 0 against 1 passes where counts are that small.

`drift` measures, per metric, the largest relative and absolute difference, the step where
it is, and the number of steps outside a band (`mhc-harness diff`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from harness.golden.compare import ApproximateCheck
from harness.golden.schema import Golden

__all__ = ["DEFAULT_BANDS", "MetricDrift", "drift", "format_drift"]

DEFAULT_BANDS: Mapping[str, ApproximateCheck] = {
    "lm loss": ApproximateCheck(rtol=1e-5, atol=0.0, max_misses=0),
    "grad-norm": ApproximateCheck(rtol=1e-3, atol=0.0, max_misses=0),
    "num-zeros": ApproximateCheck(rtol=0.2, atol=4.0, max_misses=0),
    "mhc-amax-gain-fwd": ApproximateCheck(rtol=1e-5, atol=0.0, max_misses=0),
    "mhc-amax-gain-bwd": ApproximateCheck(rtol=1e-5, atol=0.0, max_misses=0),
    "mhc-layer-gain-max": ApproximateCheck(rtol=1e-5, atol=0.0, max_misses=0),
    "mhc-sum-dev-max": ApproximateCheck(rtol=0.0, atol=1e-5, max_misses=0),
    "mtp_1 loss": ApproximateCheck(rtol=1e-5, atol=0.0, max_misses=0),
    "load_balancing_loss": ApproximateCheck(rtol=1e-5, atol=0.0, max_misses=0),
}
"""Measured bands (see the module docstring); a recipe names them with `band: default`."""


@dataclass(frozen=True, kw_only=True)
class MetricDrift:
    """How far series B is from series A (the reference) for one metric, over their common steps."""

    metric: str
    n_steps: int
    max_abs: float
    max_rel: float | None
    """`max |B - A| / |A|` over steps where A != 0 (None: A is 0 at every step)."""
    worst_step: int | None
    """The step of the largest relative difference (of the absolute one where A is 0)."""
    outside: int | None
    """Steps outside `band` (None: no band for this metric)."""
    band: ApproximateCheck | None
    only_a: tuple[int, ...] = ()
    only_b: tuple[int, ...] = ()


def drift(a: Golden, b: Golden, bands: Mapping[str, ApproximateCheck] | None = None) -> list[MetricDrift]:
    """One `MetricDrift` per metric that both hold (A's order); `bands` default to
    `DEFAULT_BANDS`."""
    bands = DEFAULT_BANDS if bands is None else bands
    out = []
    for m, sa in a.items():
        if m not in b:
            continue
        sb = b[m]
        steps = [s for s in sa.steps if s in sb.values]
        only_a = tuple(s for s in sa.steps if s not in sb.values)
        only_b = tuple(s for s in sb.steps if s not in sa.values)
        band = bands.get(m)
        if not steps:
            out.append(
                MetricDrift(
                    metric=m,
                    n_steps=0,
                    max_abs=0.0,
                    max_rel=None,
                    worst_step=None,
                    outside=None,
                    band=band,
                    only_a=only_a,
                    only_b=only_b,
                )
            )
            continue
        va = np.array([sa.values[s] for s in steps], dtype=np.float64)
        vb = np.array([sb.values[s] for s in steps], dtype=np.float64)
        diff = np.abs(vb - va)
        nz = va != 0
        rel = np.where(nz, diff / np.where(nz, np.abs(va), 1.0), 0.0)
        score = np.where(nz, rel, diff)
        i = int(np.argmax(score))
        outside = None
        if band is not None:
            outside = int(np.count_nonzero(~np.isclose(vb, va, rtol=band.rtol, atol=band.atol)))
        out.append(
            MetricDrift(
                metric=m,
                n_steps=len(steps),
                max_abs=float(diff.max()),
                max_rel=float(rel.max()) if nz.any() else None,
                worst_step=steps[i] if diff.max() > 0 else None,
                outside=outside,
                band=band,
                only_a=only_a,
                only_b=only_b,
            )
        )
    return out


def format_drift(rows: list[MetricDrift]) -> str:
    """One line per metric: largest differences, their step, steps outside the band."""
    lines = []
    for r in rows:
        rel = "n/a" if r.max_rel is None else f"{r.max_rel:.3e}"
        where = f" at step {r.worst_step}" if r.worst_step is not None else ""
        band = (
            "no default band"
            if r.band is None
            else f"{r.outside} of {r.n_steps} steps outside the default band ({r.band.describe()})"
        )
        lines.append(f"  {r.metric}: max |rel| {rel}, max |abs| {r.max_abs:.6g}{where}; {band}")
    return "\n".join(lines)
