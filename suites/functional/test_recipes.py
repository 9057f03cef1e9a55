"""The recipe format: every shipped recipe loads; bad recipes fail naming the file and the key."""

from __future__ import annotations

import re

import pytest
import yaml

from harness.golden.bands import DEFAULT_BANDS
from harness.golden.compare import ApproximateCheck, ExactCheck, TimingCheck
from harness.training.model_args import FLAGS, parse_model_args, render_cli
from harness.training.numerics import CPU_NUMERICS_ENV_VAR, CpuNumerics, cpu_numerics
from harness.training.recipe import (
    CPU_ISA_PINS,
    RECIPE_DIR,
    as_nodes,
    cpu_isa_pins,
    dump_plan,
    load_plan,
    load_recipe,
    recipe_names,
    resolve,
)

BASE = RECIPE_DIR / "gpt_tp1_pp1_mhc.yaml"
HW = "cpu_x86_64"


def _write(tmp_path, doc, name="case.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def _base():
    return yaml.safe_load(BASE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", recipe_names())
def test_shipped_recipe_loads_and_resolves(case):
    """Each recipe in recipes/ validates and resolves for every hardware key it names."""
    recipe = load_recipe(RECIPE_DIR / f"{case}.yaml")
    assert recipe.name == case and recipe.description
    for hw in recipe.hardware:
        plan = resolve(recipe, hw, variables={"FUNCTIONAL_DATA": "/data"})
        assert (
            plan.world_size
            == plan.nproc * plan.nnodes
            == plan.data_parallel_size * plan.args.model_parallel_size
        )
        assert plan.num_microbatches >= 1
        assert recipe.checks(hw)


def test_cases_pair_baseline_with_mhc_for_the_report_overlay():
    """The report pairs X with X_mhc: the mHC case has its baseline, which has mHC off."""
    names = recipe_names()
    assert {"gpt_tp1_pp1", "gpt_tp1_pp1_mhc", "gpt_tp2_pp2_mhc", "gpt3_mcore_tp2_pp2_mhc"} <= set(names)
    assert load_recipe(RECIPE_DIR / "gpt_tp1_pp1_mhc.yaml").model_args["--enable-mhc-connections"] is True
    assert "--enable-mhc-connections" not in load_recipe(RECIPE_DIR / "gpt_tp1_pp1.yaml").model_args


def test_upstream_size_recipe_is_gpu_only():
    """gpt3_mcore_tp2_pp2_mhc is upstream's size on 8 GPUs (NCCL, bf16) and has no CPU entry."""
    recipe = load_recipe(RECIPE_DIR / "gpt3_mcore_tp2_pp2_mhc.yaml")
    assert set(recipe.hardware) == {"dgx_h100"} and recipe.test_type == "ckpt-resume"
    plan = resolve(recipe, "dgx_h100")
    a = plan.args
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length) == (12, 512, 8, 1024)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, plan.data_parallel_size) == (
        2,
        2,
        2,
    )
    assert (plan.backend, a.bf16, a.train_iters, a.save_interval) == ("nccl", True, 50, 25)


def test_recipe_checks_follow_metrics_and_hardware():
    """METRICS become harness checks; the CPU entry checks only its `check` list."""
    checks = load_recipe(BASE).checks(HW)
    assert list(checks) == [
        "lm loss",
        "num-zeros",
        "grad-norm",
        "mhc-amax-gain-fwd",
        "mhc-amax-gain-bwd",
        "mhc-layer-gain-max",
        "mhc-sum-dev-max",
    ]
    assert checks["lm loss"] == (ExactCheck(), DEFAULT_BANDS["lm loss"])  # band: default
    assert checks["num-zeros"] == (ExactCheck(), ApproximateCheck(rtol=0.2, atol=4.0, max_misses=0))
    gpu = load_recipe(BASE).checks("dgx_h100")
    assert gpu["iteration-time"] == (TimingCheck(rel_band_slow=0.10, rel_band_fast=0.30),)


def test_nondeterministic_hardware_drops_exact_lane(tmp_path):
    """`deterministic: false` keeps only the approximate lanes (upstream's --allow-nondeterministic-algo)."""
    doc = _base()
    doc["HARDWARE"][HW]["deterministic"] = False
    checks = load_recipe(_write(tmp_path, doc)).checks(HW)
    assert checks["lm loss"] == (DEFAULT_BANDS["lm loss"],)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"band": "wide"}, "METRICS.lm loss.band='wide': the only named band is 'default'"),
        ({"band": "default", "rtol": 0.1}, "band: default and rtol are exclusive"),
    ],
)
def test_bad_band_is_named(tmp_path, entry, message):
    """`band:` names the default band only, and not beside explicit tolerances."""
    doc = _base()
    doc["METRICS"]["lm loss"] = {"exact": True, **entry}
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe(_write(tmp_path, doc))


def test_band_without_a_default_is_named(tmp_path):
    """`band: default` on a metric without a measured default band is refused, naming the defaults."""
    doc = _base()
    doc["METRICS"]["mem-max-rss-bytes"] = {"band": "default"}
    with pytest.raises(
        ValueError, match="no default band for 'mem-max-rss-bytes' \\(defaults: lm loss, grad-norm"
    ):
        load_recipe(_write(tmp_path, doc))


def test_overrides_and_variables_apply():
    """`resolve` fills ${FUNCTIONAL_DATA} and applies a MODEL_ARGS override (the test hook)."""
    plan = resolve(
        load_recipe(BASE), HW, variables={"FUNCTIONAL_DATA": "/d"}, overrides={"--mhc-sinkhorn-iterations": 1}
    )
    assert plan.args.data_path == "/d/declaration_text_document"
    assert plan.args.mhc_sinkhorn_iterations == 1


def test_cpu_runs_pin_the_vector_isa(tmp_path):
    """A gloo run on x86-64 gets the AVX2 pins (recipe ENV_VARS on top of them); GPU runs and other
    architectures get none."""
    plan = resolve(load_recipe(BASE), HW, variables={"FUNCTIONAL_DATA": "/d"})
    if cpu_isa_pins("gloo"):
        assert {k: plan.env[k] for k in CPU_ISA_PINS} == CPU_ISA_PINS
    assert plan.env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # the recipe's own still there
    assert cpu_isa_pins("gloo", "x86_64") == CPU_ISA_PINS == cpu_isa_pins("gloo", "AMD64")
    assert cpu_isa_pins("nccl", "x86_64") == {} == cpu_isa_pins("gloo", "aarch64")
    doc = _base()
    doc["ENV_VARS"]["ATEN_CPU_CAPABILITY"] = "default"
    plan = resolve(load_recipe(_write(tmp_path, doc)), HW, variables={"FUNCTIONAL_DATA": "/d"})
    assert plan.env["ATEN_CPU_CAPABILITY"] == "default"


def test_numerics_profile_chooses_the_pins(monkeypatch):
    """`$MHC_CPU_NUMERICS` (or `numerics=`) chooses the profile; an unknown name is an error naming it."""
    monkeypatch.setenv(CPU_NUMERICS_ENV_VAR, "baseline")
    assert cpu_numerics() is CpuNumerics.BASELINE
    plan = resolve(load_recipe(BASE), HW, variables={"FUNCTIONAL_DATA": "/d"})
    if cpu_isa_pins("gloo"):
        assert plan.env["ATEN_CPU_CAPABILITY"] == "default" and plan.env["MKL_CBWR"] == "COMPATIBLE"
    assert cpu_isa_pins("gloo", "x86_64", CpuNumerics.NATIVE) == {}
    plan = resolve(load_recipe(BASE), HW, variables={"FUNCTIONAL_DATA": "/d"}, numerics=CpuNumerics.AVX2)
    if cpu_isa_pins("gloo"):
        assert plan.env["ATEN_CPU_CAPABILITY"] == "avx2"
    monkeypatch.setenv(CPU_NUMERICS_ENV_VAR, "avx9")
    with pytest.raises(
        ValueError, match="MHC_CPU_NUMERICS='avx9' is not a CPU numerics profile; valid: avx2, "
    ):
        cpu_numerics()


def test_render_cli_matches_upstream_rules():
    """MODEL_ARGS render as upstream's runner does: true -> bare flag, lists without brackets."""
    cli = render_cli(
        {"--bf16": True, "--sequence-parallel": False, "--recompute-modules": ["mhc"], "--lr": 1e-4}
    )
    assert cli == ["--bf16", "--recompute-modules", "mhc", "--lr", "0.0001"]


def test_flags_are_megatron_style_names():
    """Every accepted flag is a megatron-style --kebab-case name, mHC flags as upstream main names them."""
    assert all(re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", f) for f in FLAGS)
    assert {
        "--enable-mhc-connections",
        "--mhc-num-residual-streams",
        "--mhc-sinkhorn-iterations",
        "--mhc-init-gating-factor",
    } <= set(FLAGS)


BAD = [
    ("unknown-top-key", lambda d: d.update(MODEL_CONFIG=1), "top level: unknown key(s) 'MODEL_CONFIG'"),
    (
        "unknown-flag",
        lambda d: d["MODEL_ARGS"].update({"--num-layer": 2}),
        "MODEL_ARGS: unknown flag '--num-layer'",
    ),
    ("flag-without-dashes", lambda d: d["MODEL_ARGS"].update({"num-layers": 2}), "(flags start with --)"),
    (
        "bad-int",
        lambda d: d["MODEL_ARGS"].update({"--num-layers": "two"}),
        "MODEL_ARGS --num-layers='two': must be an integer",
    ),
    (
        "bool-as-int",
        lambda d: d["MODEL_ARGS"].update({"--hidden-size": True}),
        "--hidden-size=True: must be an integer",
    ),
    (
        "below-minimum",
        lambda d: d["MODEL_ARGS"].update({"--mhc-sinkhorn-iterations": 0}),
        "--mhc-sinkhorn-iterations=0: must be >= 1",
    ),
    (
        "bad-choice",
        lambda d: d["MODEL_ARGS"].update({"--lr-decay-style": "exp"}),
        "--lr-decay-style='exp': valid:",
    ),
    (
        "switch-not-bool",
        lambda d: d["MODEL_ARGS"].update({"--enable-mhc-connections": "yes"}),
        "--enable-mhc-connections='yes': must be true or false",
    ),
    (
        "heads-not-dividing",
        lambda d: d["MODEL_ARGS"].update({"--num-attention-heads": 3}),
        "--hidden-size=64: must be divisible by --num-attention-heads=3",
    ),
    ("missing-flag", lambda d: d["MODEL_ARGS"].pop("--lr"), "missing required flag(s) --lr"),
    ("mock-and-path", lambda d: d["MODEL_ARGS"].update({"--mock-data": True}), "exactly one of --mock-data"),
    (
        "bad-test-type",
        lambda d: d.update(TEST_TYPE="resume"),
        "TEST_TYPE='resume': valid: regular, ckpt-resume",
    ),
    (
        "resume-without-interval",
        lambda d: d.update(TEST_TYPE="ckpt-resume"),
        "needs MODEL_ARGS --save-interval",
    ),
    (
        "unknown-metric-key",
        lambda d: d["METRICS"]["lm loss"].update(rtl=0.1),
        "METRICS.lm loss: unknown key(s) 'rtl'",
    ),
    (
        "negative-rtol",
        lambda d: d["METRICS"]["lm loss"].update(rtol=-1),
        "METRICS.lm loss.rtol=-1: must be a number >= 0",
    ),
    (
        "metric-without-check",
        lambda d: d["METRICS"].update({"x": {"exact": False}}),
        "METRICS.x={'exact': False}: names no check",
    ),
    ("timing-without-fast", lambda d: d["METRICS"].update({"t": {"timing": {"slow": 0.1}}}), "needs 'fast'"),
    (
        "unknown-hw-key",
        lambda d: d["HARDWARE"][HW].update(gpus=8),
        "HARDWARE.cpu_x86_64: unknown key(s) 'gpus'",
    ),
    (
        "bad-backend",
        lambda d: d["HARDWARE"][HW].update(backend="mpi"),
        "HARDWARE.cpu_x86_64.backend='mpi': valid: gloo, nccl",
    ),
    (
        "bad-dtype",
        lambda d: d["HARDWARE"][HW].update(dtype="fp16"),
        "HARDWARE.cpu_x86_64.dtype='fp16': valid: fp32, bf16",
    ),
    (
        "check-unknown-metric",
        lambda d: d["HARDWARE"][HW].update(check=["loss"]),
        "HARDWARE.cpu_x86_64.check=['loss']",
    ),
    (
        "missing-nproc",
        lambda d: d["HARDWARE"][HW].pop("nproc"),
        "HARDWARE.cpu_x86_64: missing required key 'nproc'",
    ),
    (
        "zero-nnodes",
        lambda d: d["HARDWARE"][HW].update(nnodes=0),
        "HARDWARE.cpu_x86_64.nnodes=0: must be an integer >= 1",
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [pytest.param(m, e, id=i) for i, m, e in BAD])
def test_bad_recipe_names_file_and_key(tmp_path, mutate, expected):
    """A bad key or value is a ValueError naming the file and the key."""
    doc = _base()
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError) as err:
        load_recipe(path)
    assert str(path) in str(err.value) and expected in str(err.value), str(err.value)


RESOLVE_BAD = [
    (
        "nproc-vs-parallelism",
        {"HARDWARE": {HW: {"nproc": 3}}},
        {"--tensor-model-parallel-size": 2},
        "HARDWARE.cpu_x86_64.nproc=3: nproc 3 = 3 ranks must be a multiple of TP*PP = 2",
    ),
    (
        "world-vs-parallelism",
        {"HARDWARE": {HW: {"nproc": 1, "nnodes": 3}}},
        {"--tensor-model-parallel-size": 2},
        "HARDWARE.cpu_x86_64.nproc=1: nproc 1 x nnodes 3 = 3 ranks must be a multiple of TP*PP = 2",
    ),
    (
        "batch-vs-dp",
        {"HARDWARE": {HW: {"nproc": 3}}},
        {},
        "MODEL_ARGS.--global-batch-size=8: must be a multiple of --micro-batch-size * DP = 2 * 3",
    ),
    ("unknown-variable", {}, {"--data-path": "${NOPE}/x_text_document"}, "unknown variable ${NOPE}"),
    (
        "sp-on-gloo",
        {"HARDWARE": {HW: {"nproc": 2}}},
        {"--sequence-parallel": True, "--tensor-model-parallel-size": 2},
        "MODEL_ARGS.--sequence-parallel=True: not possible on cpu_x86_64",
    ),
]


@pytest.mark.parametrize(
    ("hw_patch", "args_patch", "expected"), [pytest.param(h, a, e, id=i) for i, h, a, e in RESOLVE_BAD]
)
def test_bad_resolution_names_file_and_key(tmp_path, hw_patch, args_patch, expected):
    """Resolving for a hardware key checks ranks, batch sizes, variables and backend limits."""
    doc = _base()
    for hw, patch in hw_patch.get("HARDWARE", {}).items():
        doc["HARDWARE"][hw].update(patch)
    doc["MODEL_ARGS"].update(args_patch)
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError) as err:
        resolve(load_recipe(path), HW, variables={"FUNCTIONAL_DATA": "/d"})
    assert str(path) in str(err.value) and expected in str(err.value), str(err.value)


def test_nnodes_multiplies_the_world_and_keeps_the_batches(tmp_path):
    """`nnodes: 2, nproc: 2` is the world of `nproc: 4`: same DP and microbatches."""
    doc = _base()
    doc["MODEL_ARGS"].update({"--tensor-model-parallel-size": 2})
    doc["HARDWARE"][HW].update({"nproc": 2, "nnodes": 2})
    two = resolve(load_recipe(_write(tmp_path, doc)), HW, variables={"FUNCTIONAL_DATA": "/d"})
    doc["HARDWARE"][HW].update({"nproc": 4, "nnodes": 1})
    one = resolve(load_recipe(_write(tmp_path, doc)), HW, variables={"FUNCTIONAL_DATA": "/d"})
    assert (two.nnodes, two.nproc, two.world_size) == (2, 2, 4)
    assert (
        (two.data_parallel_size, two.num_microbatches)
        == (one.data_parallel_size, one.num_microbatches)
        == (2, 2)
    )
    assert as_nodes(one, 2) == two and as_nodes(two, 1) == one


def test_as_nodes_refuses_a_world_that_does_not_divide():
    """Spreading 4 ranks over 3 nodes is a ValueError naming both numbers."""
    plan = resolve(load_recipe(RECIPE_DIR / "gpt_tp2_pp2_mhc.yaml"), HW)
    with pytest.raises(ValueError, match=r"gpt_tp2_pp2_mhc: cannot spread 4 ranks over nnodes=3"):
        as_nodes(plan, 3)


def test_plan_round_trips_with_its_node_count(tmp_path):
    """dump_plan / load_plan keep nnodes (what every node's worker reads)."""
    plan = as_nodes(resolve(load_recipe(RECIPE_DIR / "gpt_tp2_pp2_mhc.yaml"), HW), 2)
    assert load_plan(dump_plan(plan, tmp_path / "plan.json")) == plan


def test_hardware_without_entry_is_an_error_naming_the_keys():
    """Resolving for a hardware key the recipe lacks names the file and the keys it has."""
    with pytest.raises(
        ValueError,
        match=r"gpt3_mcore_tp2_pp2_mhc.yaml: HARDWARE has no entry for 'cpu_x86_64' \(has: dgx_h100\)",
    ):
        resolve(load_recipe(RECIPE_DIR / "gpt3_mcore_tp2_pp2_mhc.yaml"), HW)


def test_unreadable_and_non_mapping_recipes_name_the_file(tmp_path):
    """Invalid YAML and a YAML list are errors that name the file."""
    bad_yaml = tmp_path / "a.yaml"
    bad_yaml.write_text("MODEL_ARGS: [", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(str(bad_yaml)) + ": not valid YAML"):
        load_recipe(bad_yaml)
    listed = tmp_path / "b.yaml"
    listed.write_text("- 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(str(listed)) + ": a recipe is a mapping"):
        load_recipe(listed)


def test_model_args_parse_without_a_file():
    """parse_model_args names the source it is given."""
    with pytest.raises(
        ValueError, match=r"^inline: MODEL_ARGS is missing required flag\(s\) --global-batch-size"
    ):
        parse_model_args(
            {
                "--num-layers": 1,
                "--hidden-size": 8,
                "--num-attention-heads": 1,
                "--seq-length": 8,
                "--micro-batch-size": 1,
                "--train-iters": 1,
                "--lr": 0.1,
                "--mock-data": True,
            },
            source="inline",
        )
