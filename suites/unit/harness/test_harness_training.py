"""The functional runner refuses the GPU-only features of upstream's recipes by name (CUDA graphs, the interleaved
schedule, the MoE a2a overlap), so a run never silently trains something else than the recipe says."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.launch.runs import plan_case
from harness.training.trainer import UNSUPPORTED, _refuse_unsupported


def test_upstream_ep4_cudagraph_recipe_is_refused_naming_each_flag():
    """The EP4 cudagraph recipe sets all three: each is named with its value and why."""
    plan = plan_case("gpt3_mcore_tp2_pp2_ep4_mhc_overlap_attn_cudagraph", "dgx_h100", data_dir=Path("."))
    with pytest.raises(NotImplementedError) as err:
        _refuse_unsupported(plan.args)
    text = str(err.value)
    assert "--cuda-graph-impl='transformer_engine'" in text
    assert "--num-layers-per-virtual-pipeline-stage=3" in text
    assert "--overlap-moe-expert-parallel-comm=True" in text
    assert len(UNSUPPORTED) == 3


def test_cpu_recipes_pass():
    """The CPU recipes (MoE and MTP included) set none of them."""
    for case in ("gpt_tp1_pp2_ep2_mhc_moe", "gpt_tp1_pp2_mhc_mtp", "gpt_tp2_pp2_mhc"):
        _refuse_unsupported(plan_case(case, "cpu_x86_64", data_dir=Path(".")).args)
