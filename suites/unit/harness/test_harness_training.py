"""The functional runner refuses the GPU-only features of upstream's recipes by name (CUDA graphs, the interleaved
schedule, the MoE a2a overlap), so a run never silently trains something else than the recipe says."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.launch.runs import plan_case
from harness.training.trainer import UNSUPPORTED, _refuse_unsupported

MINIMAL_MODEL_ARGS = {
    "--num-layers": 2,
    "--hidden-size": 8,
    "--num-attention-heads": 2,
    "--seq-length": 8,
    "--micro-batch-size": 1,
    "--global-batch-size": 1,
    "--train-iters": 2,
    "--lr": 1e-3,
    "--mock-data": True,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 16,
}
"""The fewest MODEL_ARGS a recipe runs with (mock data, no mHC): the flag tests add to it."""


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


def test_upstream_dsv4_hybrid_recipe_is_refused_naming_its_attention_data_and_cp():
    """Upstream's DeepSeek-V4 hybrid recipe loads as upstream wrote it (dev's mHC flag names, no --num-layers: the
    pattern counts 8) and is refused naming its MLA / DeepSeek-V4 attention, packed data and CP flags, not its
    logging ones."""
    plan = plan_case("hybrid_mr_mcore_te_tp1_pp2_dsv4_hybrid_mhc_mtp", "dgx_h100", data_dir=Path("."))
    a = plan.args
    assert (
        a.num_layers == 8
        and a.enable_mhc_connections
        and a.mhc_num_residual_streams == 4
        and a.mtp_num_layers == 1
    )
    with pytest.raises(NotImplementedError) as err:
        _refuse_unsupported(a)
    text = str(err.value)
    for flag in (
        "--multi-latent-attention=True",
        "--experimental-attention-variant='dsv4_hybrid'",
        "--context-parallel-size=2",
        "--use-varlen-dataset=True",
        "--cuda-graph-impl='transformer_engine'",
    ):
        assert flag in text, flag
    assert "--log-params-norm" not in text and "--eval-iters" not in text


def test_upstream_flags_are_typed_and_dev_aliases_are_not_set_twice():
    """An upstream-only flag of the wrong type is named; dev's name and main's of one field together are refused."""
    from harness.training.model_args import parse_model_args

    base = dict(MINIMAL_MODEL_ARGS)
    assert dict(parse_model_args({**base, "--eval-iters": 10}, source="t").upstream) == {"--eval-iters": 10}
    with pytest.raises(ValueError, match=r"t: MODEL_ARGS --q-lora-rank='big': must be an integer"):
        parse_model_args({**base, "--q-lora-rank": "big"}, source="t")
    with pytest.raises(ValueError, match="sets --enable-mhc-connections a second time"):
        parse_model_args(
            {**base, "--enable-mhc-connections": True, "--enable-hyper-connections": True}, source="t"
        )


def test_full_recompute_flags_come_together():
    """`--recompute-granularity full` needs a method and a layer count, which need it; modules need selective."""
    from harness.training.model_args import parse_model_args

    base = dict(MINIMAL_MODEL_ARGS)
    full = {"--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": 1}
    args = parse_model_args({**base, **full}, source="t")
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (
        "full",
        "block",
        1,
    )
    with pytest.raises(ValueError, match=r"t: MODEL_ARGS --recompute-num-layers=None: is needed with"):
        parse_model_args(
            {**base, "--recompute-granularity": "full", "--recompute-method": "block"}, source="t"
        )
    with pytest.raises(ValueError, match=r"--recompute-method='uniform': needs --recompute-granularity full"):
        parse_model_args({**base, "--recompute-method": "uniform"}, source="t")
    with pytest.raises(
        ValueError, match=r"--recompute-modules=\['mhc'\]: needs --recompute-granularity selective"
    ):
        parse_model_args({**base, **full, "--recompute-modules": "[mhc]"}, source="t")


def test_an_override_of_none_removes_the_recipes_flag():
    """`plan_case(..., overrides={"--recompute-modules": None})` drops the recipe's value."""
    from harness.launch.runs import plan_case

    case = "hybrid_tp1_pp2_mhc_moe_v41"
    assert plan_case(case, "cpu_x86_64", data_dir=Path("d")).args.recompute_modules == ("mhc",)
    plan = plan_case(
        case,
        "cpu_x86_64",
        data_dir=Path("d"),
        overrides={"--recompute-granularity": None, "--recompute-modules": None},
    )
    assert (plan.args.recompute_granularity, plan.args.recompute_modules) == (None, None)


def test_then_train_without_a_dump_is_refused(capsys):
    """The worker's --then-train (write the initial weights, then train on) is refused without --dump-init."""
    from harness.training.worker import parse_args

    base = ["--plan", "p.json", "--out", "o", "--data-cache", "d"]
    assert parse_args([*base, "--dump-init", "i.pt", "--then-train"]).then_train
    with pytest.raises(SystemExit):
        parse_args([*base, "--then-train"])
    assert "--then-train needs --dump-init" in capsys.readouterr().err


def test_a_run_megatron_core_cannot_checkpoint_is_refused_naming_why():
    """bf16 with fp32-kept parameters and without the distributed optimizer: refused before a step, naming why; fp32
    runs and bf16 runs with the distributed optimizer pass."""
    from types import SimpleNamespace

    from torch import nn

    from harness.training.trainer import Trainer
    from mhc_core.precision import mark_keep_in_fp32

    model = nn.Linear(2, 2)
    mark_keep_in_fp32(model.weight)

    def run(**args):
        defaults = {"bf16": False, "use_distributed_optimizer": False}
        return SimpleNamespace(
            plan=SimpleNamespace(args=SimpleNamespace(**{**defaults, **args})), model=model
        )

    Trainer.refuse_unsavable(run())  # fp32, plain optimizer: saves
    Trainer.refuse_unsavable(run(use_distributed_optimizer=True))  # fp32, distributed: saves
    Trainer.refuse_unsavable(run(bf16=True, use_distributed_optimizer=True))  # bf16, distributed: saves
    with pytest.raises(
        NotImplementedError, match=r"--bf16 with parameters kept fp32.*without --use-distributed"
    ):
        Trainer.refuse_unsavable(run(bf16=True))
