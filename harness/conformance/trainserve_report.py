"""The train/serve mismatch written out: `trainserve.json`, `trainserve.md` (the table and what a user does with
it) and `trainserve.png` (the error by depth), atomically; the single-pass form's as `trainserve-single-pass.*`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from harness.conformance.trainserve import (
    GROWTH_FACTOR,
    LEVEL_FACTOR,
    PeerMismatch,
    TrainServeSetup,
    trainer_configuration,
)
from mhc_core.forms import ConnectionForm

__all__ = ["format_table", "verdict", "write_trainserve"]


def verdict(row: PeerMismatch, trainer: PeerMismatch) -> str:
    """What a user does with `row`: its agreement with `trainer` at the deepest depth, or why it fails."""
    if not row.passed:
        return f"does not track the trainer: {row.reason}"
    return (
        f"agrees with the trainer to {row.vs_trainer[-1]:.2e} at depth {row.depths[-1]} (its error against fp64 "
        f"{row.vs_fp64[-1]:.2e}, the trainer's own bf16 error {trainer.vs_fp64[-1]:.2e})"
    )


def format_table(rows: Sequence[PeerMismatch], setup: TrainServeSetup) -> str:
    """The Markdown report."""
    trainer = rows[0]
    depth_cols = " | ".join(f"L={d} vs fp64 / vs trainer" for d in setup.depths)
    single = setup.form == ConnectionForm.SINGLE_PASS
    what = (
        "DeepSeek-V4.1 numerics, single-pass: each sublayer's input weighted with the H_pre the previous one "
        "handed on"
        if single
        else "upstream dev / DeepSeek-V4 numerics"
    )
    lines = [
        "# Train/serve mismatch of mHC" + (" (single-pass, DeepSeek-V4.1)" if single else ""),
        "",
        f"The serving engines' mHC against the trainer's (`mhc_core[{trainer_configuration(setup.form)}]` in bf16, "
        f"fp32 mappings: {what}) and the same configuration in fp64, from the same parameters and inputs: "
        f"n {setup.n}, C {setup.hidden}, {setup.tokens} tokens, {setup.iterations} Sinkhorn iterations, a stack of "
        f"{setup.depths[-1]} layers (two connections each, pre-normed `tanh` stand-ins). Worst relative error of the "
        f"streams (`max |a - e| / max |e|`) after L layers. Bound: within {LEVEL_FACTOR:g}x the trainer's own bf16 "
        f"error at every depth, and growing at most {GROWTH_FACTOR:g}x as fast.",
        "",
        f"| implementation | configuration | one connection vs fp64 / vs trainer | {depth_cols} | growth | "
        "deterministic | batch invariant | verdict |",
        "|---|---|---|" + "---|" * len(setup.depths) + "---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{a:.2e} / {b:.2e}" for a, b in zip(r.vs_fp64, r.vs_trainer, strict=True))
        inv = "yes" if r.batch_invariant else f"no (max {r.batch_max_abs:.2e})"
        what = "the reference row" if r is trainer else verdict(r, trainer)
        lines.append(
            f"| {r.name}{f' {r.version}' if r.version else ''} | {r.configuration or '?'} | "
            f"{r.connection_vs_fp64:.2e} / {r.connection_vs_trainer:.2e} | {cells} | {r.growth():.3g}x | "
            f"{'yes' if r.deterministic else 'no'} | {inv} | {what} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: Sequence[PeerMismatch], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    seen: dict[tuple[float, ...], str] = {}
    for r in rows:
        same = seen.setdefault(r.vs_fp64, r.name)
        label = r.name if same == r.name else f"{r.name} (= {same})"
        ax.plot(
            r.depths,
            [max(v, 1e-8) for v in r.vs_fp64],
            marker="o",
            label=label,
            linestyle="-" if r.passed else "--",
        )
    ax.set_xlabel("depth (layers)")
    ax.set_ylabel("worst relative error of the streams vs fp64")
    ax.set_yscale("log")
    ax.set_title("mHC train/serve mismatch by depth (bf16)")
    ax.legend(fontsize=8)
    fig.savefig(path)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_trainserve(
    rows: Sequence[PeerMismatch], setup: TrainServeSetup, out_dir: Path
) -> tuple[Path, Path, Path]:
    """`(json, md, png)` under `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "trainserve-single-pass" if setup.form == ConnectionForm.SINGLE_PASS else "trainserve"
    js, md, png = out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"
    doc = {
        "trainer": trainer_configuration(setup.form),
        "form": str(setup.form),
        "setup": {k: str(v) if k == "form" else v for k, v in vars(setup).items()},
        "bounds": {"level_factor": LEVEL_FACTOR, "growth_factor": GROWTH_FACTOR},
        "rows": [r.to_json() for r in rows],
    }
    _atomic(js, json.dumps(doc, indent=1) + "\n")
    _atomic(md, format_table(rows, setup))
    tmp = png.with_name(f".{stem}.tmp.png")
    _plot(rows, tmp)
    tmp.replace(png)
    return js, md, png
