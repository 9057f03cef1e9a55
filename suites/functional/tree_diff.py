"""A Megatron-LM tree's training of a recipe against ours: same initial weights, same data, step by step.

Launches of one recipe on one hardware key (`harness.launch.runs`):

1. `dump_init`: our model of the recipe (with the tree's numerics, `OUR_NUMERICS`) writes its initial
   full state dict (`harness.training.model_state`) and stops;
2. `run_ours`: our integration trains from it (or, `write_init`, writes it and trains on: 1 and 2 in one
   launch, which is how the tests run them);
3. `run_tree`: the tree trains from it with its own GPT, schedules, DDP and optimizer (the tree first on
   `PYTHONPATH`: `harness.upstream.megatron_tree.tree_env`).

`differences` puts 2 and 3 side by side per metric under the approximate bands (`harness.golden.bands`).
Recordings of 3 (`record_tree.py`) let a machine without a tree replay the comparison.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.golden.bands import DEFAULT_BANDS, MetricDrift, drift
from harness.golden.compare import ApproximateCheck
from harness.golden.schema import to_golden
from harness.launch.runs import RunResult, plan_case, run_plan
from harness.launch.torchrun import LaunchError
from harness.training.recipe import RECIPE_DIR, load_recipe
from harness.upstream.megatron_tree import Tree, tree_env
from harness.upstream.tree_report import TreeRow

__all__ = [
    "CASES",
    "METRICS",
    "OUR_NUMERICS",
    "RECIPE_DIR",
    "differences",
    "dump_init",
    "file_sha256",
    "functional_checks",
    "recipe_sha256",
    "skip_reason",
    "run_ours",
    "run_tree",
]

CASES = (
    "gpt_tp2_pp2_mhc",
    "gpt_tp1_pp1_mhc",
    "gpt_tp1_pp1_mhc_gate1",
    "gpt_tp1_pp2_ep2_mhc_moe",
    "gpt_tp1_pp2_mhc_mtp",
    "hybrid_tp1_pp2_mhc_moe",
    "hybrid_tp1_pp2_mhc_moe_mtp",
    "gpt_tp1_pp1_mhc_bf16",
    "hybrid_tp1_pp2_mhc_moe_bf16",
)
"""The recipes a tree trains: TP 2 x PP 2 (4 ranks, 20 steps: upstream's gpt3_mcore_tp2_pp2_mhc at CPU
size), the one-rank mHC recipes (24 steps; gate1 starts the gates at 1.0, so that the mix is far from
uniform from step 1 and an orientation or variant difference shows in the loss), MoE with EP 2, MTP, the
hybrid stack (the tree's own `HybridModel`), and the dense and hybrid recipes in bf16 mixed precision with the
distributed optimizer (the tree's own fp32-kept mHC parameters)."""


def skip_reason(case: str, hw: str, flavor: str) -> str | None:
    """Why the tree's `flavor` cannot train `case` (main's schedules carry C wide tensors), or None."""
    from harness.upstream.tree_model import MAIN_PP_NOTE

    plan = plan_case(case, hw, data_dir=Path("."))
    if flavor == "main" and plan.args.pipeline_model_parallel_size > 1:
        return f"{case} has PP {plan.args.pipeline_model_parallel_size}: {MAIN_PP_NOTE}"
    return None


METRICS = (
    "lm loss",
    "grad-norm",
    "num-zeros",
    "mtp_1 loss",
    "load_balancing_loss",
    "mhc-amax-gain-fwd",
    "mhc-amax-gain-bwd",
)
"""Compared step by step, each where both runs have it: the MTP and router losses on those recipes; the
stability monitor's composite gains (`mhc_core.monitor` reads the tree's own hyper connections too, probing
the matrix each applies through its own `fused_h_res_h_post_bda`; recordings made before it did hold none)."""

OUR_NUMERICS: Mapping[str, Mapping[str, Any]] = {
    "dev": {"--mhc-variant": "megatron_dev", "--mhc-learned-contraction": True},
    "main": {"--mhc-variant": "megatron_main"},
}
"""The MODEL_ARGS that make our integration compute what the tree's branch computes."""


def recipe_sha256(case: str) -> str:
    """sha256 of `recipes/<case>.yaml`: a recording is replayed only against the recipe it was made from."""
    return file_sha256(RECIPE_DIR / f"{case}.yaml")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def dump_init(case: str, hw: str, flavor: str, *, work_dir: Path, data_dir: Path) -> Path:
    """Our model of `case` (the `flavor`'s numerics) writes its initial full state dict; its path."""
    plan = plan_case(case, hw, data_dir=data_dir, overrides=OUR_NUMERICS[flavor])
    out = Path(work_dir) / "init.pt"
    run_plan(plan, Path(work_dir), data_dir=data_dir, worker_args=["--dump-init", out])
    return out


def run_ours(
    case: str, hw: str, flavor: str, init: Path, *, work_dir: Path, data_dir: Path, write_init: bool = False
) -> RunResult:
    """Our integration trains `case` with the `flavor`'s numerics from `init`, or (`write_init`) from the weights
    it builds, which it writes to `init` first: what `dump_init` writes, in the same launch."""
    plan = plan_case(case, hw, data_dir=data_dir, overrides=OUR_NUMERICS[flavor])
    args = ["--dump-init", init, "--then-train"] if write_init else ["--init", init]
    return run_plan(plan, Path(work_dir), data_dir=data_dir, worker_args=args)


def run_tree(
    case: str,
    hw: str,
    tree: Tree,
    init: Path,
    *,
    work_dir: Path,
    data_dir: Path,
    save: Path | None = None,
    load: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> RunResult:
    """The tree trains `case` from `init` with its own model, schedules, DDP and optimizer; a failed launch
    is a `LaunchError` naming the tree (`env`: added to the ranks', e.g. a planted crash)."""
    plan = plan_case(case, hw, data_dir=data_dir)
    try:
        return run_plan(
            plan,
            Path(work_dir),
            data_dir=data_dir,
            save=save,
            load=load,
            env={**tree_env(tree.path), **(env or {})},
            worker_args=["--tree-flavor", tree.flavor, "--init", init],
        )
    except LaunchError as err:
        raise LaunchError(
            f"the Megatron-LM tree {tree.label} ({tree.path}) failed training {case} on {hw}: {err}",
            err.result,
        ) from None


def bands_for(case: str, hw: str) -> dict[str, ApproximateCheck]:
    """The bands a tree's run of `case` must keep to ours: the default bands (measured for fp32 runs), except in a
    half-precision recipe, whose own approximate bands (measured across the CPU numerics profiles in bf16,
    `docs/measurements/cpu-2026-12-07-bf16/`) replace them metric by metric."""
    recipe = load_recipe(RECIPE_DIR / f"{case}.yaml")
    bands = dict(DEFAULT_BANDS)
    if recipe.hardware_spec(hw).dtype in ("bf16", "fp16"):
        for metric, checks in recipe.checks(hw).items():
            approx = [c for c in checks if isinstance(c, ApproximateCheck)]
            if approx:
                bands[metric] = approx[0]
    return bands


def differences(
    ours: Mapping[str, Mapping[int, float]],
    theirs: Mapping[str, Mapping[int, float]],
    metrics: tuple[str, ...] = METRICS,
    bands: Mapping[str, ApproximateCheck] = DEFAULT_BANDS,
) -> list[MetricDrift]:
    """Per metric, how far `ours` is from `theirs` (the reference) under `bands` (`bands_for` the recipe)."""
    pick = {m: dict(theirs[m]) for m in metrics if m in theirs}
    mine = {m: dict(ours[m]) for m in metrics if m in ours}
    rows = drift(
        to_golden(pick, source="the tree's run"),
        to_golden(mine, source="our run"),
        {m: bands[m] for m in metrics if m in pick or m in mine},
    )
    # A metric one side logs and the other does not is a difference too (drift covers the metrics both hold).
    for m in [m for m in metrics if (m in pick) != (m in mine)]:
        rows.append(
            MetricDrift(
                metric=m,
                n_steps=0,
                max_abs=0.0,
                max_rel=None,
                worst_step=None,
                outside=None,
                band=bands.get(m),
                only_a=tuple(sorted(pick.get(m, {}))),
                only_b=tuple(sorted(mine.get(m, {}))),
            )
        )
    return rows


def describe(rows: list[MetricDrift]) -> str:
    """One line per metric: worst relative difference, its step, steps outside the band."""
    out = []
    for r in rows:
        if r.n_steps == 0 and (r.only_a or r.only_b):
            out.append(
                f"{r.metric}: logged only by {'the tree' if r.only_a else 'ours'} "
                f"({len(r.only_a or r.only_b)} steps)"
            )
            continue
        rel = "n/a" if r.max_rel is None else f"{r.max_rel:.2e}"
        out.append(
            f"{r.metric}: worst rel {rel} (abs {r.max_abs:.2e}) at step {r.worst_step}, "
            f"{r.outside} of {r.n_steps} steps outside rtol {r.band.rtol:g} atol {r.band.atol:g}"
        )
    return "\n".join(out)


def as_json(metrics: Mapping[str, Mapping[int, float]]) -> dict[str, dict[str, float]]:
    return {m: {str(k): float(v) for k, v in sorted(s.items())} for m, s in metrics.items()}


def from_json(doc: Mapping[str, Mapping[str, float]]) -> dict[str, dict[int, float]]:
    return {m: {int(k): float(v) for k, v in s.items()} for m, s in doc.items()}


def dumps(doc: Any) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def functional_checks(case: str, hw: str) -> dict[str, Any]:
    """The recipe's checks of `METRICS` on `hw` (exact lane and bands), for the tree's ckpt-resume."""
    from harness.training.recipe import load_recipe

    return {m: c for m, c in load_recipe(RECIPE_DIR / f"{case}.yaml").checks(hw).items() if m in METRICS}


def worst(rows: list[MetricDrift]) -> dict[str, float]:
    """`{metric: worst relative difference}` (the absolute one where the reference is 0 at every step)."""
    return {r.metric: (r.max_rel if r.max_rel is not None else r.max_abs) for r in rows}


def retention_row(case: str, tree_label: str, out_dir: Path) -> TreeRow:
    """What the tree's ranks keep of a step (`harness.training.retention`), as the tree's finding: bytes by
    holder, megatron-core's own holders apart; never fails (a tree is reported, ours is checked)."""
    from harness.training.retention import RetentionReport

    reports = [
        RetentionReport.from_json(json.loads(f.read_text()), source=str(f))
        for f in sorted(out_dir.glob("retention-rank*.json"))
    ]
    held: dict[str, int] = {}
    for report in reports:
        for f in report.errors():
            held[f.where] = held.get(f.where, 0) + f.bytes
    note = "; ".join(f"{where}: {b:,} bytes" for where, b in sorted(held.items())) or "nothing of a step"
    return TreeRow(
        suite="functional",
        case=case,
        comparison="tree keeps after a step",
        tree=tree_label,
        worst={"retained bytes": float(sum(held.values()))},
        ok=True,
        note=f"{len(reports)} rank report(s): {note}",
    )
