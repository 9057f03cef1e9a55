"""`HyperConnectionTransformerLayer`: shapes in and out, what its sublayers see, its guards,
selective recompute, and the CUDA-graph hooks (static inputs, captured submodules)."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.transformer.enums import CudaGraphScope  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402

from mhc_core import HyperConnectionModule  # noqa: E402
from mhc_core.megatron import HyperConnectionTransformerLayer, get_gpt_layer_local_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 4
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(config, spec=None, seed=0):
    torch.manual_seed(seed)
    return build_module(spec or get_gpt_layer_local_spec(enable_mhc=True), config=config, layer_number=1).to(
        DEVICE
    )


def _with_submodules(**changes):
    spec = get_gpt_layer_local_spec(enable_mhc=True)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


@pytest.fixture
def streams(dims):
    """A layer input `[s, b, n*C]` with distinct streams."""
    return (
        torch.randn(dims.s, dims.b, N * dims.c, generator=torch.Generator().manual_seed(3))
        .to(DEVICE)
        .requires_grad_()
    )


@pytest.fixture
def mask(batch):
    return batch["attention_mask"]


def test_layer_maps_streams_to_streams(make_config, streams, mask):
    """The layer takes and returns [s, b, n*C]."""
    out, context = _layer(make_config(n=N))(hidden_states=streams, attention_mask=mask)
    assert out.shape == streams.shape and context is None


def test_sublayers_see_one_stream(make_config, streams, mask, dims):
    """Layernorms, attention and MLP all receive [s, b, C]."""
    layer = _layer(make_config(n=N))
    seen = {}
    for name in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
        getattr(layer, name).register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(name, tuple(args[0].shape))
        )
    layer(hidden_states=streams, attention_mask=mask)
    assert seen == dict.fromkeys(seen, (dims.s, dims.b, dims.c)) and len(seen) == 4


def test_hyper_connections_are_built_with_layer_number(make_config):
    """Both slots become HyperConnectionModule(config, layer_number); the cross-attention slot stays IdentityOp."""
    from megatron.core.transformer.identity_op import IdentityOp

    layer = _layer(make_config(n=N))
    for hc in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
        assert type(hc) is HyperConnectionModule and hc.layer_number == layer.layer_number and hc.n == N
    assert isinstance(layer.cross_attention_hyper_connection, IdentityOp)


def test_mhc_layer_without_the_flag_is_rejected(make_config):
    """Building the mHC layer with enable_mhc_connections off is a ValueError naming the flag."""
    with pytest.raises(ValueError, match="enable_mhc_connections must be True"):
        _layer(make_config())


@pytest.mark.parametrize("slot", ["self_attention_hyper_connection", "mlp_hyper_connection"])
def test_identity_hyper_connection_slot_is_rejected(make_config, slot):
    """An mHC layer whose attention or MLP slot is IdentityOp is a ValueError naming the slot."""
    from megatron.core.transformer.identity_op import IdentityOp

    with pytest.raises(ValueError, match=f"submodules.{slot} must be a hyper connection"):
        _layer(make_config(n=N), _with_submodules(**{slot: IdentityOp}))


def test_cross_attention_hyper_connection_is_rejected(make_config):
    """A cross-attention hyper connection is a ValueError (it must stay IdentityOp)."""
    with pytest.raises(ValueError, match="cross_attention_hyper_connection must be IdentityOp"):
        _layer(make_config(n=N), _with_submodules(cross_attention_hyper_connection=HyperConnectionModule))


def test_stock_submodules_are_rejected(make_config):
    """The mHC layer with plain TransformerLayerSubmodules (no slots) is a ValueError."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as stock_spec

    spec = dataclasses.replace(stock_spec(), module=HyperConnectionTransformerLayer)
    with pytest.raises(ValueError, match="use HyperConnectionTransformerLayerSubmodules"):
        _layer(make_config(n=N), spec)


class _NormWithResidual(torch.nn.Module):
    """A norm that also returns its input, as fused norm-add kernels do."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x):
        return self.norm(x), x


def test_norm_returning_a_tuple_is_rejected(make_config, streams, mask):
    """A layernorm that returns (out, residual) is a ValueError naming the norm."""
    layer = _layer(make_config(n=N), _with_submodules(input_layernorm=_NormWithResidual))
    with pytest.raises(ValueError, match=re.escape("input_layernorm returned a tuple of 2")):
        layer(hidden_states=streams, attention_mask=mask)


def test_selective_recompute_matches_plain_layer(make_config, streams, mask):
    """Selective recompute of the layernorms and the MLP gives the same output and gradients."""
    plain = _layer(make_config(n=N))
    recomputed = _layer(
        make_config(n=N, recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    )
    recomputed.load_state_dict(plain.state_dict())
    assert (
        recomputed.recompute_input_layernorm
        and recomputed.recompute_pre_mlp_layernorm
        and recomputed.recompute_mlp
    )
    results = []
    for layer in (plain, recomputed):
        x = streams.detach().clone().requires_grad_()
        out, _ = layer(hidden_states=x, attention_mask=mask)
        out.square().mean().backward()
        results.append((out.detach(), x.grad, [p.grad for p in layer.parameters()]))
    (o1, g1, p1), (o2, g2, p2) = results
    torch.testing.assert_close(o2, o1, rtol=0, atol=0)
    torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-7)
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("norm", "sublayer"), [("post_self_attn_layernorm", "self_attention"), ("post_mlp_layernorm", "mlp")]
)
def test_sandwich_norm_of_newer_megatron_is_applied(make_config, streams, mask, norm, sublayer):
    """A post-sublayer ("sandwich") norm, as newer megatron-core layers carry, normalises the sublayer output [s, b, C]."""
    layer = _layer(make_config(n=N))
    plain, _ = layer(hidden_states=streams, attention_mask=mask)
    seen = []
    getattr(layer, sublayer).register_forward_hook(lambda _m, _a, out: seen.append(out[0]))
    setattr(layer, norm, torch.nn.LayerNorm(layer.config.hidden_size).to(DEVICE))
    getattr(layer, norm).register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    sandwiched, _ = layer(hidden_states=streams, attention_mask=mask)
    assert len(seen) == 2 and seen[1] is seen[0]
    assert not torch.equal(sandwiched, plain)


def test_mlp_recompute_keeps_the_bias_a_leaf(make_config, streams, mask):
    """Under MLP recompute the MLP's bias parameter stays a leaf (stock megatron-core 0.16.1 with
    torch 2.13 gives it the checkpoint's grad_fn, and backward then never ends)."""
    layer = _layer(make_config(n=N, recompute_granularity="selective", recompute_modules=["mlp"]))
    layer(hidden_states=streams, attention_mask=mask)
    assert layer.mlp.linear_fc2.bias.is_leaf


def test_static_inputs_are_n_streams_wide(make_config, monkeypatch, dims):
    """get_layer_static_inputs (CUDA graphs) gives hidden_states [s, b, n*C]."""
    if not torch.cuda.is_available():  # the stock method allocates on torch.cuda.current_device()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    static = _layer(make_config(n=N)).get_layer_static_inputs(dims.s, dims.b)
    assert static["hidden_states"].shape == (dims.s, dims.b, N * dims.c)
    assert static["hidden_states"].requires_grad


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        ([CudaGraphScope.attn], ["self_attention_hyper_connection"]),
        ([CudaGraphScope.mlp], ["mlp_hyper_connection"]),
        (
            [CudaGraphScope.attn, CudaGraphScope.mlp],
            ["self_attention_hyper_connection", "mlp_hyper_connection"],
        ),
    ],
    ids=["attn", "mlp", "attn-mlp"],
)
def test_cuda_graph_scope_covers_the_hyper_connections(make_config, scope, expected):
    """The submodules under a scoped CUDA graph include the hyper connection of each captured sublayer."""
    # Through the config's constructor, as a user sets it: megatron-core 0.19 moves `cuda_graph_scope`
    # into `cuda_graph_modules` there and clears it (0.16 keeps it).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 0.19: "cuda_graph_scope is deprecated"
        layer = _layer(make_config(n=N, cuda_graph_scope=scope))
    assert _captured_hyper_connections(layer) == expected


@pytest.mark.skipif(
    "cuda_graph_modules" not in {f.name for f in dataclasses.fields(TransformerConfig)},
    reason="megatron-core < 0.19 has no cuda_graph_modules",
)
@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        (["attn"], ["self_attention_hyper_connection"]),
        (["mlp"], ["mlp_hyper_connection"]),
        (["attn", "mlp"], ["self_attention_hyper_connection", "mlp_hyper_connection"]),
    ],
    ids=["attn", "mlp", "attn-mlp"],
)
def test_cuda_graph_modules_cover_the_hyper_connections(make_config, modules, expected):
    """megatron-core 0.19's `cuda_graph_modules`: the hyper connection of each captured sublayer."""
    layer = _layer(make_config(n=N, cuda_graph_modules=modules))
    assert _captured_hyper_connections(layer) == expected


def _captured_hyper_connections(layer) -> list[str]:
    submodules = layer._get_submodules_under_cudagraphs()
    return [
        name
        for name in ("self_attention_hyper_connection", "mlp_hyper_connection")
        if any(m is getattr(layer, name) for m in submodules)
    ]


def test_mhc_layer_is_a_transformer_layer():
    """The mHC layer is a TransformerLayer subclass (megatron's block fans the spec out to every layer)."""
    assert issubclass(HyperConnectionTransformerLayer, TransformerLayer)
