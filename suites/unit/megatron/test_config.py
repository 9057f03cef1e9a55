"""`MHCTransformerConfig`: defaults, upstream field names, and every validation error with its message."""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mhc_core import HyperConnectionConfig, Variant  # noqa: E402
from mhc_core.megatron import MHCTransformerConfig  # noqa: E402


def test_is_a_transformer_config_dataclass(make_config):
    """MHCTransformerConfig is a dataclass subclass of TransformerConfig."""
    cfg = make_config()
    assert isinstance(cfg, TransformerConfig)
    assert dataclasses.is_dataclass(MHCTransformerConfig)


def test_defaults_match_upstream_main(make_config):
    """mHC is off by default; n=4, 20 Sinkhorn iterations, gating 0.01, variant megatron_main, unfused."""
    cfg = make_config()
    assert (cfg.enable_mhc_connections, cfg.mhc_num_residual_streams, cfg.mhc_sinkhorn_iterations) == (
        False,
        4,
        20,
    )
    assert (cfg.mhc_init_gating_factor, cfg.mhc_variant, cfg.use_fused_mhc) == (0.01, "megatron_main", False)
    assert cfg.mhc_learned_contraction is False


def test_fields_feed_the_module_config(make_config):
    """HyperConnectionConfig.from_transformer_config reads the mHC fields off the megatron config."""
    cfg = make_config(n=3, mhc_sinkhorn_iterations=7, mhc_init_gating_factor=0.5, mhc_variant="paper")
    hc = HyperConnectionConfig.from_transformer_config(cfg)
    assert (hc.hidden_size, hc.num_residual_streams, hc.sinkhorn_iterations) == (32, 3, 7)
    assert (hc.init_gating_factor, hc.variant) == (0.5, Variant.PAPER)


def test_variant_enum_is_normalised_to_its_name(make_config):
    """A Variant member is stored as its plain string name."""
    assert make_config(mhc_variant=Variant.MEGATRON_DEV).mhc_variant == "megatron_dev"


def test_pipeline_parallelism_is_allowed(make_config):
    """Unlike upstream main, pipeline_model_parallel_size > 1 is accepted with mHC."""
    cfg = make_config(n=4, num_layers=4, pipeline_model_parallel_size=2)
    assert cfg.pipeline_model_parallel_size == 2


INVALID_VALUES = [
    pytest.param({"mhc_sinkhorn_iterations": 0}, "mhc_sinkhorn_iterations=0", id="iterations-0"),
    pytest.param({"mhc_sinkhorn_iterations": 2.0}, "mhc_sinkhorn_iterations=2.0", id="iterations-float"),
    pytest.param({"mhc_init_gating_factor": -0.1}, "mhc_init_gating_factor=-0.1", id="gating-negative"),
    pytest.param({"mhc_init_gating_factor": float("nan")}, "mhc_init_gating_factor=nan", id="gating-nan"),
    pytest.param({"mhc_num_residual_streams": 0}, "mhc_num_residual_streams=0", id="streams-0"),
    pytest.param({"mhc_num_residual_streams": True}, "mhc_num_residual_streams=True", id="streams-bool"),
    pytest.param({"mhc_variant": "v3"}, "mhc_variant='v3'", id="variant-unknown"),
    pytest.param(
        {"mhc_init_gating_factor": float("inf")},
        "mhc_init_gating_factor=inf: must be a finite number",
        id="gating-inf",
    ),
    pytest.param({"use_fused_mhc": "False"}, "use_fused_mhc='False': must be True or False", id="fused-str"),
    pytest.param(
        {"mhc_learned_contraction": 1}, "mhc_learned_contraction=1: must be True or False", id="learned-int"
    ),
    pytest.param(
        {"recompute_granularity": "selective", "recompute_modules": "mhc"},
        "recompute_modules='mhc': must be a list of module names",
        id="recompute-str",
    ),
    pytest.param(
        {"recompute_granularity": "selective", "recompute_modules": ["MHC"]},
        "Invalid choices for recompute_modules: {'MHC'}",
        id="recompute-unknown",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID_VALUES)
@pytest.mark.parametrize("enabled", [False, True], ids=["mhc-off", "mhc-on"])
def test_invalid_value_raises_value_error_naming_field(make_config, overrides, message, enabled):
    """A bad mHC field value is a ValueError naming the field and the value, whether mHC is on or off."""
    n = 4 if enabled else None
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(n=n, **overrides)


INCOMPATIBLE = [
    pytest.param(
        {"fp32_residual_connection": True},
        NotImplementedError,
        "fp32_residual_connection=True",
        id="fp32-residual",
    ),
    pytest.param(
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        NotImplementedError,
        "recompute_granularity='full'",
        id="full-recompute",
    ),
    pytest.param({"hidden_size": 0, "num_attention_heads": 1}, ValueError, "hidden_size=0", id="hidden-0"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), INCOMPATIBLE)
def test_incompatible_setting_with_mhc_raises(make_config, overrides, error, message):
    """With mHC on, an unsupported combination raises the documented error type, naming the field."""
    with pytest.raises(error, match=re.escape(message)):
        make_config(n=4, **overrides)


@pytest.mark.parametrize("field", ["use_fused_mhc", "mhc_learned_contraction", "mhc_norm_eps_inside_sqrt"])
def test_option_without_mhc_raises(make_config, field):
    """An mHC option without enable_mhc_connections is a ValueError naming the field."""
    with pytest.raises(ValueError, match=rf"{field}=True: requires enable_mhc_connections=True"):
        make_config(**{field: True})


def test_learned_contraction_accepted_with_dev_variant(make_config):
    """mhc_learned_contraction is valid with mhc_variant='megatron_dev'."""
    cfg = make_config(n=2, mhc_variant="megatron_dev", mhc_learned_contraction=True)
    assert cfg.mhc_learned_contraction


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"mhc_variant": "megatron_dev"}, "megatron_dev"),
        (
            {
                "mhc_variant": "megatron_dev",
                "mhc_norm_eps_inside_sqrt": True,
                "mhc_learned_contraction": True,
            },
            "megatron_dev+eps_inside_sqrt+learned_exit",
        ),
        (
            {"mhc_variant": "megatron_dev", "mhc_keep_mappings_in_fp32": False},
            "megatron_dev+activation_mappings",
        ),
        (
            {"mhc_keep_mappings_in_fp32": True, "mhc_learned_contraction": True},
            "megatron_main+fp32_mappings+learned_exit",
        ),
    ],
)
def test_numerics_options_name_the_configuration(make_config, overrides, name):
    """The option fields (upstream PR #7521's names) make a named configuration of the variant."""
    assert make_config(n=2, **overrides).mhc_numerics.name == name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mhc_norm_eps_inside_sqrt": "yes"}, "mhc_norm_eps_inside_sqrt='yes': must be True or False"),
        ({"mhc_keep_mappings_in_fp32": 1}, "mhc_keep_mappings_in_fp32=1: must be True or False"),
        ({"mhc_variant": "megatron_dev+eps_inside_sqrt"}, "set its options with mhc_norm_eps_inside_sqrt"),
    ],
)
def test_bad_numerics_options(make_config, overrides, message):
    """A non-bool option, or options folded into mhc_variant, is a ValueError naming the field."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(n=2, **overrides)


@pytest.mark.parametrize(
    "overrides",
    [{"fp32_residual_connection": True}],
    ids=["fp32-residual"],
)
def test_compatibility_rules_apply_only_with_mhc_on(make_config, overrides):
    """Settings rejected with mHC are accepted when mHC is off."""
    make_config(**overrides)


def test_a_string_switch_does_not_turn_mhc_on(make_config):
    """enable_mhc_connections="False" (truthy) is refused, not read as True."""
    with pytest.raises(ValueError, match=re.escape("enable_mhc_connections='False': must be True or False")):
        make_config(enable_mhc_connections="False")


def test_unknown_recompute_module_lists_mhc_among_the_valid(make_config):
    """megatron's list of recompute modules lacks 'mhc'; the error this config raises adds it."""
    with pytest.raises(ValueError, match=r"Allowed modules are: .*, and 'mhc'"):
        make_config(n=4, recompute_granularity="selective", recompute_modules=["MHC"])


def test_numpy_integers_are_stored_as_ints(make_config):
    """NumPy integers for the mHC counts are accepted and stored as Python ints."""
    import numpy as np

    cfg = make_config(
        enable_mhc_connections=True, mhc_num_residual_streams=np.int64(4), mhc_sinkhorn_iterations=np.int32(7)
    )
    assert (cfg.mhc_num_residual_streams, cfg.mhc_sinkhorn_iterations) == (4, 7)
    assert type(cfg.mhc_num_residual_streams) is int and type(cfg.mhc_sinkhorn_iterations) is int
