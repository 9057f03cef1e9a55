"""Spec wiring: `enable_mhc` on the GPT layer specs (local / TE x on / off) and `build_gpt_model`'s checks."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.models.gpt import GPTModel, gpt_layer_specs  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402

from mhc_core import HyperConnectionModule  # noqa: E402
from mhc_core.megatron import (  # noqa: E402
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
    MHCGPTModel,
    compat,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    to_mhc_layer_spec,
)

BACKENDS = {
    "local": (get_gpt_layer_local_spec, gpt_layer_specs.get_gpt_layer_local_spec),
    "te": (
        get_gpt_layer_with_transformer_engine_spec,
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec,
    ),
}
VARIANTS = [pytest.param({}, id="default"), pytest.param({"qk_layernorm": True}, id="qk-layernorm")]


def _backend(name: str):
    if name == "te" and not compat.transformer_engine_available():
        pytest.skip("transformer_engine is not importable here (it does not install on a CPU machine)")
    return BACKENDS[name]


def _same(a, b) -> bool:
    """Equal specs; megatron-core 0.19 builds entries as fresh `functools.partial`s, which compare
    by identity, so fall back to their (address-free, deterministic) repr."""
    return a == b or repr(a) == repr(b)


@pytest.mark.parametrize("kwargs", VARIANTS)
@pytest.mark.parametrize("backend", ["local", "te"])
def test_flag_on_gives_mhc_layer_and_slots(backend, kwargs):
    """enable_mhc=True: module HyperConnectionTransformerLayer, both slots HyperConnectionModule, cross slot IdentityOp."""
    ours, _ = _backend(backend)
    spec = ours(enable_mhc=True, **kwargs)
    assert spec.module is HyperConnectionTransformerLayer
    assert type(spec.submodules) is HyperConnectionTransformerLayerSubmodules
    assert spec.submodules.self_attention_hyper_connection is HyperConnectionModule
    assert spec.submodules.mlp_hyper_connection is HyperConnectionModule
    assert spec.submodules.cross_attention_hyper_connection is IdentityOp


@pytest.mark.parametrize("kwargs", VARIANTS)
@pytest.mark.parametrize("backend", ["local", "te"])
def test_flag_off_returns_the_stock_spec(backend, kwargs):
    """enable_mhc=False: exactly megatron-core's spec (TransformerLayer, no hyper-connection slots)."""
    ours, stock = _backend(backend)
    spec = ours(enable_mhc=False, **kwargs)
    assert _same(spec, stock(**kwargs))
    assert spec.module is TransformerLayer
    assert not hasattr(spec.submodules, "self_attention_hyper_connection")


@pytest.mark.parametrize("backend", ["local", "te"])
def test_flag_on_keeps_every_stock_submodule(backend):
    """The mHC spec carries the stock submodules (norms, attention, MLP, BDA, key map) unchanged."""
    ours, stock = _backend(backend)
    mhc, base = ours(enable_mhc=True), stock()
    for name, value in vars(base.submodules).items():
        assert _same(getattr(mhc.submodules, name), value), name
    assert mhc.params == base.params


def test_te_spec_without_transformer_engine_raises_import_error():
    """Without transformer_engine the TE wrapper raises an ImportError that says what to use instead."""
    if compat.transformer_engine_available():
        pytest.skip("transformer_engine is importable here")
    with pytest.raises(ImportError, match="needs transformer_engine.*get_gpt_layer_local_spec"):
        get_gpt_layer_with_transformer_engine_spec(enable_mhc=True)


def test_to_mhc_layer_spec_rejects_a_non_transformer_layer_spec():
    """Only a spec of exactly TransformerLayer can be turned into an mHC spec (not an mHC spec again)."""
    with pytest.raises(ValueError, match="must be a ModuleSpec of TransformerLayer"):
        to_mhc_layer_spec(get_gpt_layer_local_spec(enable_mhc=True))


def test_build_gpt_model_returns_mhc_model_only_with_flag(megatron_world, make_config, build_gpt):
    """build_gpt_model: MHCGPTModel with mHC on, a stock GPTModel (exact type) with it off."""
    assert isinstance(build_gpt(make_config(n=2)), MHCGPTModel)
    assert type(build_gpt(make_config())) is GPTModel


@pytest.mark.parametrize(
    ("enabled", "enable_mhc"), [(True, False), (False, True)], ids=["stock-spec-mhc-on", "mhc-spec-mhc-off"]
)
def test_build_gpt_model_rejects_a_spec_that_contradicts_the_flag(
    make_config, build_gpt, enabled, enable_mhc
):
    """A layer spec whose class does not match config.enable_mhc_connections is a ValueError."""
    config = make_config(n=2) if enabled else make_config()
    with pytest.raises(ValueError, match="does not match config.enable_mhc_connections"):
        build_gpt(config, spec=get_gpt_layer_local_spec(enable_mhc=enable_mhc))


def test_build_gpt_model_rejects_an_unknown_spec_name(make_config, build_gpt):
    """spec must be 'local', 'te' or a ModuleSpec."""
    with pytest.raises(ValueError, match="spec='apex'"):
        build_gpt(make_config(), spec="apex")
