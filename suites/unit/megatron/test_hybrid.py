"""The hybrid stack with mHC (`mhc_core.megatron.hybrid`): one hyper connection around each layer of a pattern,
single-branch layers feeding their raw branch output into the n-stream update, dev's keys, the symbols a CPU cannot
run refused with their reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from mhc_core.megatron.hybrid import (  # noqa: E402
    HyperConnectionHybridLayer,
    gpt_key,
    hybrid_block_spec,
    hybrid_layout,
    parse_pattern,
)
from suites.unit.megatron.conftest import SEQ, VOCAB  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 4
MOE: dict[str, Any] = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    ffn_hidden_size=64,
    add_bias_linear=False,
    moe_aux_loss_coeff=1e-2,
)


DENSE: dict[str, Any] = dict(ffn_hidden_size=64, add_bias_linear=False)
"""The MLPs of `MOE`'s models without experts."""


def _model(make_config, pattern: str = "*-*E", seed: int = 0, **overrides: Any) -> Any:
    from mhc_core.megatron.gpt import MHCGPTModel
    from mhc_core.megatron.hybrid import hybrid_mtp_block_spec, split_mtp

    base = MOE if "E" in pattern else DENSE
    main, _, depths = split_mtp(pattern)
    mtp = {"mtp_num_layers": depths, "mtp_loss_scaling_factor": 0.1} if depths else {}
    config = make_config(n=N, num_layers=len(main.replace("|", "")), **{**base, **mtp, **overrides})
    torch.manual_seed(seed)
    extra = (
        {"mtp_block_spec": hybrid_mtp_block_spec(config, pattern), "position_embedding_type": "rope"}
        if depths
        else {}
    )
    return MHCGPTModel(
        config, hybrid_block_spec(config, pattern), vocab_size=VOCAB, max_sequence_length=2 * SEQ, **extra
    )


def _bad_gradients(model: Any) -> dict[str, float | None]:
    """The parameters whose gradient is missing, non-finite or zero: `{name: max |grad| or None}`."""
    return {
        n: None if p.grad is None else float(p.grad.abs().max())
        for n, p in model.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.abs().max() > 0
    }


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    ).mean()


def test_pattern_parsing_and_layout():
    """`|` splits stages; the layout names them for megatron-core (embedding first, loss last)."""
    assert parse_pattern("*-|*E") == ["*-", "*E"]
    assert hybrid_layout("*-|*E") == "Ett|ttL" and hybrid_layout("*-*E") == "EttttL"
    assert parse_pattern("*-|*E/*E/*E") == ["*-", "*E"] and hybrid_layout("*-|*E/*E/*E") == "Ett|ttmmL"


@pytest.mark.parametrize(
    ("pattern", "error", "match"),
    [
        ("*M-", NotImplementedError, r"'M' at position 1: Mamba needs mamba_ssm"),
        (
            "W-",
            NotImplementedError,
            r"'W' at position 0: DeepSeek-V4's windowed attention needs Transformer Engine",
        ),
        ("*x", ValueError, r"unknown symbol 'x' at position 1"),
        ("*-||E", ValueError, r"stage 1 holds no layer"),
    ],
    ids=["mamba", "dsv4-attention", "unknown", "empty-stage"],
)
def test_a_pattern_that_cannot_run_here_is_refused_with_why(pattern, error, match):
    with pytest.raises(error, match=match):
        parse_pattern(pattern)


@pytest.mark.parametrize("variant", ["megatron_main", "megatron_dev+learned_exit", "paper"])
def test_every_parameter_of_a_hybrid_mhc_model_gets_a_gradient(make_config, batch, variant):
    """`*-*E` (attention, MLP, attention, MoE) trains: finite loss, every parameter a finite non-zero gradient."""
    name, _, option = variant.partition("+")
    model = _model(make_config, mhc_variant=name, mhc_learned_contraction=option == "learned_exit")
    assert all(
        isinstance(layer, HyperConnectionHybridLayer) and layer.single_branch
        for layer in model.decoder.layers
    )
    loss = _loss(model, batch)
    loss.backward()
    bad = _bad_gradients(model)
    assert torch.isfinite(loss) and not bad, bad


def test_mtp_depths_of_the_pattern_train_on_the_streams(make_config, batch):
    """`*E/*E` (dev's unified pattern: a decoder of attention and MoE, one MTP depth of the same kinds) trains with
    dev's numerics: the depth's inner layers are hybrid layers nested on the n streams, its loss is tracked, every
    parameter gets a finite non-zero gradient; the keys are dev's (`mtp.layers.0.e_proj`, the inner layers')."""
    from mhc_core.megatron.hybrid import HybridLayerSequence
    from mhc_core.megatron.mtp import tracked_mtp_losses

    model = _model(make_config, "*E/*E", mhc_variant="megatron_dev", mhc_learned_contraction=True)
    depth = model.mtp.layers[0]
    inner = next(m for m in depth.children() if isinstance(m, HybridLayerSequence))
    assert [type(layer).__name__ for layer in inner.layers] == ["HyperConnectionHybridLayer"] * 2
    loss = _loss(model, batch)
    loss.backward()
    assert tracked_mtp_losses() is not None
    bad = _bad_gradients(model)
    assert torch.isfinite(loss) and not bad, bad
    keys = set(model.state_dict())
    assert {"mtp.layers.0.e_proj.weight", "mtp.layers.0.h_proj.weight", "mtp.layers.0.hc_head_fn"} <= keys
    assert any(".layers.1.inner_layer.mlp.router.weight" in k and k.startswith("mtp.") for k in keys), sorted(
        keys
    )


@pytest.mark.parametrize(
    ("pattern", "match"),
    [
        ("*E/*E/-", "every MTP depth has the same layers"),
        ("*E/", "holds no layer"),
        ("*E/*|E", "holds no stage boundary"),
    ],
)
def test_bad_mtp_depths_are_named(pattern, match):
    """Depths that differ, an empty depth or a stage boundary inside one are refused, naming the pattern."""
    with pytest.raises(ValueError, match=match):
        parse_pattern(pattern)


def test_keys_are_devs(make_config):
    """One hyper connection per layer under `hyper_connection`, the wrapped layer under `inner_layer`."""
    sd = _model(make_config).state_dict()
    assert "decoder.layers.0.hyper_connection.mapping_proj.weight" in sd
    assert "decoder.layers.0.inner_layer.self_attention.linear_qkv.weight" in sd
    assert "decoder.layers.3.inner_layer.mlp.router.weight" in sd
    assert not [k for k in sd if "self_attention_hyper_connection" in k or "mlp_hyper_connection" in k]


def test_the_sharded_state_dict_keys_every_parameter_per_layer(make_config):
    """Distributed checkpointing sees every parameter under its layer's own key (the layers differ in kind, so no
    tensor is stacked over all of them), the learned exit's `hc_head_*` included."""
    model = _model(make_config, mhc_variant="megatron_dev", mhc_learned_contraction=True)
    sharded = model.sharded_state_dict()
    params = {name for name, _ in model.named_parameters()}
    assert params <= set(sharded), sorted(params - set(sharded))
    assert "decoder.layers.3.inner_layer.mlp.router.weight" in sharded and "decoder.hc_head_fn" in sharded
    stacked = [
        f"{name} -> {t.key}"
        for name, t in sharded.items()
        if name.startswith("decoder.layers.")
        and hasattr(t, "key")
        and not t.key.startswith("decoder.layers." + name.split(".")[2] + ".")
    ]
    assert not stacked, stacked[:5]


@pytest.mark.parametrize("index", [0, 1, 3], ids=["attention", "mlp", "moe"])
def test_a_single_branch_layer_feeds_its_raw_branch_output(make_config, batch, index):
    """The layer's output is the hyper connection's update of the branch's raw output (no residual added first),
    bit for bit."""
    model = _model(make_config).eval()
    layer = model.decoder.layers[index]
    seen: dict[str, Any] = {}

    def keep_input(module, args, kwargs):
        seen.setdefault("x", kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def keep_output(module, args, out):
        seen.setdefault("out", out[0])

    layer.register_forward_pre_hook(keep_input, with_kwargs=True)
    layer.register_forward_hook(keep_output)
    with torch.no_grad():
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        hc, inner = layer.hyper_connection, layer.inner_layer
        aggregated, h_res, h_post, residual = hc(seen["x"])
        if index == 0:
            rope = (
                model.rotary_pos_emb(batch["input_ids"].shape[1])
                if hasattr(model, "rotary_pos_emb")
                else None
            )
            y = inner.self_attention(
                inner.input_layernorm(aggregated), attention_mask=batch["attention_mask"], rotary_pos_emb=rope
            )
        else:
            y = inner.mlp(inner.pre_mlp_layernorm(aggregated))
        want = hc.post_residual_bda(h_res, residual, h_post, (y[0], y[1]), inner.hidden_dropout, False)
    assert torch.equal(seen["out"], want), float((seen["out"] - want).abs().max())


def _loss_and_grads(model: Any, batch: dict[str, torch.Tensor], seed: int = 11) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = _loss(model, batch)
    loss.backward()
    return loss.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("per_group", [None, 1], ids=["chunk", "per-layer"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_mhc_recompute_equals_the_plain_run(make_config, batch, per_group, dropout, recompute_states):
    """With "mhc" recompute the hybrid stack's loss and every gradient equal the run without it, bitwise (dropout
    masks replayed), and the n-stream states inside a group are not kept after forward (only its anchor)."""
    plain = _model(make_config, seed=1, hidden_dropout=dropout).train()
    recomputed = _model(
        make_config,
        seed=1,
        hidden_dropout=dropout,
        recompute_granularity="selective",
        recompute_modules=["mhc"],
        mhc_recompute_layer_num=per_group,
    ).train()
    recomputed.load_state_dict(plain.state_dict())
    want_loss, want = _loss_and_grads(plain, batch)
    recompute_states.clear()  # the plain run makes none; start from the recomputed run's forward
    torch.manual_seed(11)
    recomputed.zero_grad(set_to_none=True)
    loss = _loss(recomputed, batch)
    made = list(recompute_states)
    kept = [not r.expired() for r in made[:-1]]
    loss.backward()
    got = {n: p.grad for n, p in recomputed.named_parameters() if p.grad is not None}
    assert len(made) == 4 and kept == ([False] * 3 if per_group is None else [True] * 3), kept
    assert torch.equal(loss.detach(), want_loss) and got.keys() == want.keys()
    different = [n for n in want if not torch.equal(got[n], want[n])]
    assert not different, different


def test_the_stage_count_must_match_the_pipeline(make_config):
    """A pattern of two stages on one pipeline stage is a configuration error naming both."""
    config = make_config(n=N, num_layers=4, **MOE)
    with pytest.raises(ValueError, match=r"has 2 stages; the config runs PP 1 x VPP 1"):
        hybrid_block_spec(config, "*-|*E")


@pytest.mark.parametrize("variant", ["megatron_main", "megatron_dev+learned_exit"])
def test_a_hybrid_of_attention_and_mlp_layers_is_the_gpt(make_config, build_gpt, batch, variant):
    """Upstream's cross-family equivalence, for mHC: the hybrid `*-*-` and a two-layer GPT from the same weights
    (keys mapped: each GPT sublayer is one hybrid layer with its own hyper connection) give the same loss and
    the same gradients, bit for bit."""
    name, _, option = variant.partition("+")
    numerics = dict(mhc_variant=name, mhc_learned_contraction=option == "learned_exit")
    hybrid = _model(make_config, "*-*-", **numerics)
    gpt = build_gpt(make_config(n=N, num_layers=2, **DENSE, **numerics))
    state = {gpt_key(k): v for k, v in hybrid.state_dict().items()}
    missing = set(gpt.state_dict()) ^ set(state)
    assert not missing, sorted(missing)[:6]
    gpt.load_state_dict(state)
    losses = [_loss(m, batch) for m in (hybrid, gpt)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1]), [float(x) for x in losses]
    grads = {gpt_key(n): p.grad for n, p in hybrid.named_parameters()}
    diff = {
        n: float((p.grad - grads[n]).abs().max())
        for n, p in gpt.named_parameters()
        if not torch.equal(p.grad, grads[n])
    }
    assert not diff, diff
