"""ckpt-resume cases: a second launch from the checkpoint at N/2 reproduces the uninterrupted run; a bf16 case's
checkpoint keeps the mHC parameters fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.golden.compare import ExactCheck, compare, format_results
from harness.golden.schema import to_golden
from harness.training.checkpoint import iteration_dir
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


BF16_RESUME_CASES = [
    c
    for c in RESUME_CASES
    if "cpu_x86_64" in load_recipe(RECIPE_DIR / f"{c}.yaml").hardware
    and load_recipe(RECIPE_DIR / f"{c}.yaml").hardware["cpu_x86_64"].dtype == "bf16"
]


def _tensor_dtypes(checkpoint: Path) -> dict[str, torch.dtype]:
    """{key: dtype} of every tensor in a torch_dist checkpoint directory (read from its `.metadata` alone)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    return {
        key: item.properties.dtype
        for key, item in metadata.state_dict_metadata.items()
        if hasattr(item, "properties")
    }


@pytest.mark.parametrize("case", BF16_RESUME_CASES)
def test_bf16_checkpoint_keeps_mhc_params_fp32(case, functional_runs):
    """In a bf16 run's checkpoint every mHC parameter is fp32 and every other model tensor bf16; the distributed
    optimizer's state of the fp32 parameters (their own buffer) is fp32."""
    reason = functional_runs.skip_reason(case)
    if reason:
        pytest.skip(reason)
    full = functional_runs.run(case)
    dtypes = _tensor_dtypes(iteration_dir(functional_runs.checkpoints(case), full.plan.args.save_interval))
    model = {k: d for k, d in dtypes.items() if not k.startswith(("optimizer.", "rng_state"))}
    mhc = {k: d for k, d in model.items() if "hyper_connection" in k or "hc_head" in k}
    rest = {k: d for k, d in model.items() if k not in mhc}
    assert mhc and set(mhc.values()) == {torch.float32}, mhc
    assert rest and set(rest.values()) == {torch.bfloat16}, rest
    fp32_buffer = {k: d for k, d in dtypes.items() if ".dtype_(torch.float32, torch.float32)." in k}
    assert {k.rsplit(".", 1)[1] for k in fp32_buffer} == {"param", "exp_avg", "exp_avg_sq"}, sorted(dtypes)
    assert set(fp32_buffer.values()) == {torch.float32}, fp32_buffer
