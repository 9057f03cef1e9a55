"""No activation outlives its step: every functional launch checks its ranks (`harness.training.retention`)."""

from __future__ import annotations

import json

import pytest

from harness.launch.torchrun import LaunchError
from harness.training.recipe import RECIPE_DIR
from harness.training.retention import PLANT_ENV_VAR, RetentionReport
from suites.functional.session import RETAINED_BYTES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PLANT_CASE = "gpt_tp1_pp1_mhc"
PLANTED = "decoder.layers.1.mlp_hyper_connection"
"""The module that keeps its output in the planted run (the last sublayer's hyper connection)."""

SHAPES = {
    "dense": "gpt_tp1_pp1_mhc",
    "dense-pp2-tp2": "gpt_tp2_pp2_mhc",
    "moe-ep2": "gpt_tp1_pp2_ep2_mhc_moe",
    "mtp": "gpt_tp1_pp2_mhc_mtp",
    "hybrid": "hybrid_tp1_pp2_mhc_moe",
    "hybrid-mtp": "hybrid_tp1_pp2_mhc_moe_mtp",
    "single-pass-mhc-recompute": "hybrid_tp1_pp2_mhc_moe_v41",
    "dense-bf16-distributed-optimizer": "gpt_tp1_pp1_mhc_bf16",
    "hybrid-bf16-distributed-optimizer": "hybrid_tp1_pp2_mhc_moe_bf16",
}
"""Each model shape the suite trains -> its recipe (the session's cached run: no extra launch)."""


def test_a_planted_retention_fails_the_launch_naming_the_attribute(functional_runs, monkeypatch):
    """A hyper connection that keeps its forward output: the launch fails after its last step naming the module,
    the attribute, the shape and the bytes; no metrics are written."""
    reason = functional_runs.skip_reason(PLANT_CASE)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv(PLANT_ENV_VAR, PLANTED)
    with pytest.raises(LaunchError) as err:
        functional_runs.fresh(PLANT_CASE, "planted-retention", overrides={"--train-iters": 3})
    message = str(err.value)
    plan = functional_runs.plan(PLANT_CASE).args
    tokens, n, c = plan.seq_length * plan.micro_batch_size, plan.mhc_num_residual_streams, plan.hidden_size
    shape = f"[{plan.seq_length}x{plan.micro_batch_size}x{c}]"  # the aggregated branch input [s, b, C]
    assert (
        f"step 3: module.{PLANTED}._planted_activation {shape} float32, {tokens * c * 4} bytes" in message
    ), message[-3000:]
    assert n > 1
    run_dir = functional_runs.root / PLANT_CASE / "planted-retention"
    assert not (run_dir / "metrics.json").exists()
    report = RetentionReport.from_json(
        json.loads((run_dir / "retention-rank0.json").read_text()), source=str(run_dir)
    )
    assert [f.where for f in report.errors()] == [f"module.{PLANTED}._planted_activation"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_model_shape_keeps_nothing_of_a_step(functional_runs, shape, request):
    """Every rank of the shape's run: no error finding (the launch would have failed), what megatron-core keeps
    named and counted; bytes recorded for the summary."""
    case = SHAPES[shape]
    assert (RECIPE_DIR / f"{case}.yaml").exists(), case
    reason = functional_runs.skip_reason(case)
    if reason:
        pytest.skip(reason)
    run = functional_runs.run(case)
    files = sorted(run.out_dir.glob("retention-rank*.json"))
    assert len(files) == run.plan.nproc, f"{case}: {len(files)} retention reports for {run.plan.nproc} ranks"
    reports = [RetentionReport.from_json(json.loads(f.read_text()), source=str(f)) for f in files]
    errors = [e.line() for r in reports for e in r.errors()]
    assert not errors, errors
    last = max(f.step for r in reports for f in r.findings) if any(r.findings for r in reports) else None
    kept = sum(f.bytes for r in reports for f in r.findings if f.step == last)
    request.config.stash.setdefault(RETAINED_BYTES, {})[f"{shape} ({case})"] = (
        sum(r.inventory_bytes for r in reports),
        kept,
        sum(r.seconds for r in reports),
    )
