"""PNG plots for reports (matplotlib's Agg canvas, no pyplot state, no display needed).

* `plot_case` -- golden vs actual curves of one case, one panel per metric.
* `plot_overlay` -- any labelled series of one metric in one plot, e.g. a baseline and an
  mHC case of the same suite (the functional suite can call it directly).
* `mhc_pairs` -- the naming convention `report` uses to pair cases automatically: a case
  whose name contains `_mhc` is paired with the case named the same without `_mhc`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from harness.golden.schema import Golden, MetricSeries

__all__ = ["hc_pairs", "loss_metrics", "mhc_pairs", "plot_case", "plot_overlay", "stability_metrics"]


def _figure(n_panels: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.2 * n_panels), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_panels, 1, squeeze=False)[:, 0]
    return fig, list(axes)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def loss_metrics(golden: Mapping[str, MetricSeries]) -> list[str]:
    """Metric names that are losses (contain `loss`), in order."""
    return [m for m in golden if "loss" in m]


def stability_metrics(golden: Mapping[str, MetricSeries]) -> list[str]:
    """The mHC stability monitor's composite Amax gains (`mhc-amax-gain-*`), in order."""
    return [m for m in golden if m.startswith("mhc-amax-gain")]


def plot_overlay(
    series: Mapping[str, MetricSeries], *, metric: str, path: str | Path, title: str | None = None
) -> Path:
    """Plot `{label: series}` of one metric in one axes; returns the PNG path."""
    if not series:
        raise ValueError("series must hold at least one labelled MetricSeries")
    fig, (ax,) = _figure()
    for label, s in series.items():
        ax.plot(list(s.steps), list(s.values.values()), label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title or metric)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_case(
    actual: Golden, golden: Golden | None, *, metrics: Sequence[str], path: str | Path, title: str
) -> Path:
    """Golden (dashed) vs actual (solid) for `metrics` of one case, one panel each."""
    if not metrics:
        raise ValueError("metrics must name at least one metric to plot")
    fig, axes = _figure(len(metrics))
    for ax, m in zip(axes, metrics, strict=True):
        if golden is not None and m in golden:
            g = golden[m]
            ax.plot(list(g.steps), list(g.values.values()), "--", label="golden", linewidth=1.2)
        if m in actual:
            a = actual[m]
            ax.plot(list(a.steps), list(a.values.values()), label="actual", linewidth=1.0)
        ax.set_xlabel("step")
        ax.set_ylabel(m)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_title(title)
    return _save(fig, path)


def mhc_pairs(cases: Iterable[str]) -> list[tuple[str, str]]:
    """`(baseline, mhc)` pairs by name: `gpt_tp1_mhc` pairs with `gpt_tp1`."""
    names = set(cases)
    return sorted(
        (c.replace("_mhc", "", 1), c) for c in names if "_mhc" in c and c.replace("_mhc", "", 1) in names
    )


def hc_pairs(cases: Iterable[str]) -> list[tuple[str, str]]:
    """`(hc, mhc)` pairs by name: `gpt_tp1_hc` (unconstrained Hyper-Connections) pairs with `gpt_tp1_mhc`."""
    names = set(cases)
    return sorted(
        (c, c.replace("_hc", "_mhc", 1))
        for c in names
        if "_hc" in c and "_mhc" not in c and c.replace("_hc", "_mhc", 1) in names
    )
