"""The DeepSeek-V4 state-dict bridge on a real mini mHC GPT: converted both ways, the mHC parts of both
sides give the same coefficients, mixed streams and block exit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip(
    "transformers.models.deepseek_v4",
    reason="transformers with DeepSeek-V4 (the peers extra) is not installed",
)

from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from harness.peers.hf_deepseek_v4 import HfDeepseekV4Peer  # noqa: E402
from mhc_core.megatron.deepseek_v4_names import from_deepseek_v4, to_deepseek_v4  # noqa: E402
from mhc_core.testing import assert_close, tolerance  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 4


@pytest.fixture
def model(make_config, build_gpt):
    """A 2-layer megatron_dev mHC GPT with the learned block exit, its mHC parameters moved off their init
    (alphas ~1, random bias) so that H_res is far from uniform."""
    gpt = build_gpt(
        make_config(n=N, mhc_variant="megatron_dev", mhc_learned_contraction=True, layernorm_epsilon=1e-6)
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "hyper_connection.alpha" in name:
                p.fill_(0.7 + 0.6 * float(torch.rand((), generator=g)))
            elif name.endswith("hyper_connection.bias") or "hc_head_base" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return gpt


def _hf(model):
    c = model.config
    cfg = DeepseekV4Config(
        hidden_size=c.hidden_size,
        hc_mult=N,
        hc_sinkhorn_iters=c.mhc_sinkhorn_iterations,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
    )
    hf = to_deepseek_v4(model.state_dict(), variant=model.config.mhc_variant)
    layers = []
    for i in range(c.num_layers):
        mods = {}
        for sub in ("attn_hc", "ffn_hc"):
            m = DeepseekV4HyperConnection(cfg)
            m.load_state_dict(
                {k.rsplit(".", 1)[1]: v for k, v in hf.items() if k.startswith(f"model.layers.{i}.{sub}.")}
            )
            mods[sub] = m
        layers.append(mods)
    head = DeepseekV4HyperHead(cfg)
    head.load_state_dict({k.rsplit(".", 1)[1]: v for k, v in hf.items() if k.startswith("model.hc_head.")})
    return hf, layers, head


def test_names_and_shapes(model):
    """Every mHC tensor maps to DeepSeek-V4's names with its shape; the alphas become one scale [3]."""
    hf, _, _ = _hf(model)
    c = model.config
    assert set(hf) == {
        f"model.layers.{i}.{s}.{p}"
        for i in range(c.num_layers)
        for s in ("attn_hc", "ffn_hc")
        for p in ("fn", "base", "scale")
    } | {"model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"}
    sd = model.state_dict()
    assert torch.equal(
        hf["model.layers.1.ffn_hc.fn"], sd["decoder.layers.1.mlp_hyper_connection.mapping_proj.weight"]
    )
    assert torch.equal(
        hf["model.layers.0.attn_hc.scale"],
        torch.cat(
            [
                sd[f"decoder.layers.0.self_attention_hyper_connection.alpha_{a}"]
                for a in ("pre", "post", "res")
            ]
        ),
    )


def test_round_trip_is_exact(model):
    """DeepSeek-V4 names back to ours give the same tensors bit for bit."""
    sd = model.state_dict()
    back = from_deepseek_v4(to_deepseek_v4(sd, variant="megatron_dev"))
    assert set(back) == {k for k in sd if "hyper_connection" in k or "hc_head" in k}
    assert all(torch.equal(back[k], sd[k]) for k in back)


def test_both_sides_compute_the_same_mhc(model):
    """After conversion, each sublayer's coefficients, aggregate and mixed streams, and the block exit, agree
    with DeepSeek-V4's modules within the fp32 bounds."""
    _, layers, head = _hf(model)
    s, b, c = 5, 2, model.config.hidden_size
    g = torch.Generator().manual_seed(11)
    x = torch.randn(s, b, N * c, generator=g)
    y = torch.randn(s, b, c, generator=g)
    tol = tolerance(torch.float32, "fwd")
    for i, layer in enumerate(model.decoder.layers):
        for ours, theirs in (
            (layer.self_attention_hyper_connection, layers[i]["attn_hc"]),
            (layer.mlp_hyper_connection, layers[i]["ffn_hc"]),
        ):
            aggregated, h_res, h_post, residual = ours(x)
            streams = x.view(s, b, N, c).transpose(0, 1)  # [b, s, n, C]
            post, comb, collapsed = theirs(streams)
            assert_close(f"layer {i} h_post", h_post.transpose(0, 1), post, tol)
            assert_close(f"layer {i} h_res", h_res.transpose(0, 1), comb, tol)
            assert_close(f"layer {i} aggregate", aggregated.transpose(0, 1), collapsed, tol)
            mixed = ours.post_residual_bda(h_res, residual, h_post, (y, None), dropout_p=0.0)
            hf_mixed = HfDeepseekV4Peer().mix(
                comb.reshape(b * s, N, N),
                streams.reshape(b * s, N, c),
                post.reshape(b * s, N),
                y.transpose(0, 1).reshape(b * s, c),
            )
            assert_close(
                f"layer {i} mixed", mixed.view(s, b, N, c).transpose(0, 1).reshape(b * s, N, c), hf_mixed, tol
            )
    exit_ours = model.decoder.contract_streams(x)
    assert_close("block exit", exit_ours.transpose(0, 1), head(x.view(s, b, N, c).transpose(0, 1)), tol)


def test_other_variants_and_bad_input_are_refused(model):
    """A megatron_main model is refused (another function under DeepSeek-V4's names), so are an empty
    state dict, a sublayer missing a parameter, and a scale of the wrong shape, each named."""
    sd = model.state_dict()
    with pytest.raises(
        ValueError, match="variant='megatron_main': DeepSeek-V4 computes megatron_dev's convention"
    ):
        to_deepseek_v4(sd, variant="megatron_main")
    with pytest.raises(ValueError, match="no mHC parameters"):
        to_deepseek_v4({"decoder.final_layernorm.weight": torch.ones(2)}, variant="megatron_dev")
    partial = {k: v for k, v in sd.items() if k != "decoder.layers.1.mlp_hyper_connection.alpha_res"}
    with pytest.raises(ValueError, match="decoder.layers.1.mlp_hyper_connection: missing alpha_res"):
        to_deepseek_v4(partial, variant="megatron_dev")
    with pytest.raises(ValueError, match=r"model.layers.0.attn_hc.scale: scale must have shape \[3\]"):
        from_deepseek_v4({"model.layers.0.attn_hc.scale": torch.ones(2)})


def test_checkpoint_names_are_what_transformers_loader_renames(model):
    """The checkpoint naming is DeepSeek's released one: transformers' own loader (its deepseek_v4 renamings,
    `rename_source_key`) turns each of our checkpoint names into the transformers name we give the tensor;
    the round trip from the checkpoint names is exact; an unknown naming is refused."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    sd = model.state_dict()
    hf = to_deepseek_v4(sd, variant="megatron_dev")
    ckpt = to_deepseek_v4(sd, variant="megatron_dev", names="checkpoint")
    assert "layers.0.hc_attn_fn" in ckpt and "hc_head_scale" in ckpt and len(ckpt) == len(hf)
    transforms = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = {k.removeprefix("model."): v for k, v in hf.items()}
    renamed = {
        rename_source_key(k, renamings, converters, base_model_prefix="model", meta_state_dict=meta)[0]: v
        for k, v in ckpt.items()
    }
    assert set(renamed) == {k.removeprefix("model.") for k in hf}
    assert all(torch.equal(renamed[k.removeprefix("model.")], v) for k, v in hf.items())
    back = from_deepseek_v4(ckpt)
    assert all(torch.equal(back[k], sd[k]) for k in back) and len(back) == len(from_deepseek_v4(hf))
    with pytest.raises(ValueError, match="names='hub': valid: transformers, checkpoint"):
        to_deepseek_v4(sd, variant="megatron_dev", names="hub")


def _torchtitan_mhc_map(tree):
    """The mHC rows of torchtitan's DeepSeek-V4 `from_hf_map` (checkpoint name -> torchtitan name), read as data
    from its state_dict_adapter.py (the module itself imports the whole model)."""
    import ast

    source = (tree / "torchtitan/models/deepseek_v4/state_dict_adapter.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Attribute) and t.attr == "from_hf_map" for t in node.targets)
        ):
            pairs = {
                ast.literal_eval(k): ast.literal_eval(v)
                for k, v in zip(node.value.keys, node.value.values, strict=True)
            }
            return {k: v for k, v in pairs.items() if "hc_" in k}
    raise AssertionError("no from_hf_map dict in torchtitan's DeepSeek-V4 state_dict_adapter.py")


def test_torchtitans_adapter_beside_ours(model):
    """From a torchtitan tree (MHC_TORCHTITAN): our checkpoint names, through torchtitan's own adapter map, land
    on its HcPre / HcHead parameters, which then compute our coefficients, aggregate and block exit."""
    import os
    import re
    from pathlib import Path

    tree = os.environ.get("MHC_TORCHTITAN")
    if not tree:
        pytest.skip("MHC_TORCHTITAN is not set (a torchtitan checkout of PR #3634)")
    from harness.peers.torchtitan import load_torchtitan_mhc

    mhc = load_torchtitan_mhc(Path(tree).resolve())
    table = _torchtitan_mhc_map(Path(tree))
    ckpt = to_deepseek_v4(model.state_dict(), variant="megatron_dev", names="checkpoint")
    titan = {}
    for key, value in ckpt.items():
        layer = re.match(r"^layers\.(\d+)\.(.*)$", key)
        pattern = f"layers.{{}}.{layer.group(2)}" if layer else key
        assert pattern in table, f"{key}: torchtitan's adapter has no row for it"
        titan[table[pattern].format(layer.group(1)) if layer else table[pattern]] = value
    c = model.config
    s, b = 5, 2
    x = torch.randn(s, b, N * c.hidden_size, generator=torch.Generator().manual_seed(5))
    streams = x.view(s, b, N, c.hidden_size).transpose(0, 1)  # [b, s, n, C]
    tol = tolerance(torch.float32, "fwd")
    for i, layer in enumerate(model.decoder.layers):
        for ours, sub in (
            (layer.self_attention_hyper_connection, "hc_attn_pre"),
            (layer.mlp_hyper_connection, "hc_ffn_pre"),
        ):
            pre = mhc.HcPre.Config(
                hc_mult=N, dim=c.hidden_size, sinkhorn_iters=c.mhc_sinkhorn_iterations
            ).build()
            pre.load_state_dict(
                {k.rsplit(".", 1)[1]: v for k, v in titan.items() if k.startswith(f"layers.{i}.{sub}.")}
            )
            aggregated, h_res, h_post, _ = ours(x)
            y, post, comb = pre(streams)
            assert_close(f"layer {i} {sub} h_post", h_post.transpose(0, 1), post, tol)
            assert_close(f"layer {i} {sub} aggregate", aggregated.transpose(0, 1), y, tol)
            # torchtitan's Sinkhorn is not DeepSeek-V4's (docs/conformance.md): at these logits its guard moves
            # H_res by ~1e-5 (3.7e-6 .. 1.1e-5 measured), about the fp32 bound, so it gets ten times that
            gap = float((h_res.transpose(0, 1) - comb).detach().abs().max())
            assert gap < 1e-4, f"layer {i} {sub}: H_res differs by {gap:.3e}"
    head = mhc.HcHead.Config(hc_mult=N, dim=c.hidden_size).build()
    head.load_state_dict({k.rsplit(".", 1)[1]: v for k, v in titan.items() if k.startswith("hc_head.")})
    assert_close("block exit", model.decoder.contract_streams(x).transpose(0, 1), head(streams), tol)


@pytest.fixture
def hybrid(make_config):
    """The hybrid stack `*E*E` (two logical DeepSeek-V4 layers: attention, then MoE) in megatron_dev with the learned
    block exit, its mHC parameters moved off their init."""
    from mhc_core.megatron.gpt import MHCGPTModel
    from mhc_core.megatron.hybrid import hybrid_block_spec

    config = make_config(
        n=N,
        num_layers=4,
        mhc_variant="megatron_dev",
        mhc_learned_contraction=True,
        layernorm_epsilon=1e-6,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        ffn_hidden_size=64,
        add_bias_linear=False,
    )
    torch.manual_seed(0)
    model = MHCGPTModel(config, hybrid_block_spec(config, "*E*E"), vocab_size=64, max_sequence_length=16)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hyper_connection." in name or "hc_head" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_a_hybrid_stacks_keys_map_per_logical_layer_both_ways(hybrid):
    """Hybrid layer 2i's hyper connection is logical layer i's `attn_hc`, 2i+1's its `ffn_hc` (each tensor bit for
    bit, in both namings), the head is `hc_head`; back with `form="hybrid"` gives the hybrid keys and tensors."""
    sd = hybrid.state_dict()
    hf = to_deepseek_v4(sd, variant="megatron_dev")
    assert set(hf) == {
        f"model.layers.{i}.{s}.{p}"
        for i in range(2)
        for s in ("attn_hc", "ffn_hc")
        for p in ("fn", "base", "scale")
    } | {"model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"}
    assert torch.equal(
        hf["model.layers.1.ffn_hc.fn"], sd["decoder.layers.3.hyper_connection.mapping_proj.weight"]
    )
    assert torch.equal(hf["model.layers.1.attn_hc.base"], sd["decoder.layers.2.hyper_connection.bias"])
    for names in ("transformers", "checkpoint"):
        back = from_deepseek_v4(to_deepseek_v4(sd, variant="megatron_dev", names=names), form="hybrid")
        assert set(back) == {k for k in sd if "hyper_connection" in k or "hc_head" in k}, names
        assert all(torch.equal(back[k], sd[k]) for k in back), names
    with pytest.raises(ValueError, match="form='moe': valid: gpt, hybrid"):
        from_deepseek_v4(hf, form="moe")
