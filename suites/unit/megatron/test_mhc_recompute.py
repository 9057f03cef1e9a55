"""mHC recompute (`"mhc"` in `recompute_modules`) in a megatron-core GPT: same numbers, fewer kept states.

The n-stream states inside a recompute group are dropped from autograd's saved tensors in forward
and rebuilt in backward (`mhc_core.recompute`); the loss and every gradient must equal the run
without it, bitwise on CPU.
"""

from __future__ import annotations

import pytest
import torch

from mhc_core.recompute import StreamRecompute

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 2


def _config(make_config, *, layers=4, recompute=True, per_group=None, modules=("mhc",), **extra):
    kw = dict(num_layers=layers, **extra)
    if recompute:
        kw.update(
            recompute_granularity="selective",
            recompute_modules=list(modules),
            mhc_recompute_layer_num=per_group,
        )
    return make_config(n=N, **kw)


def _loss_and_grads(model, batch, seed=11):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    loss = out.float().mean()
    loss.backward()
    return loss.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("per_group", [None, 1, 3], ids=["chunk", "per-layer", "groups-of-3"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_loss_and_gradients_equal_the_plain_run(make_config, build_gpt, batch, per_group, dropout):
    """With "mhc" recompute the loss and every gradient equal the run without it, bitwise (dropout masks replayed)."""
    plain = build_gpt(_config(make_config, recompute=False, hidden_dropout=dropout), seed=1).train()
    recomputed = build_gpt(_config(make_config, per_group=per_group, hidden_dropout=dropout), seed=1).train()
    recomputed.load_state_dict(plain.state_dict())
    (l1, g1), (l2, g2) = _loss_and_grads(plain, batch), _loss_and_grads(recomputed, batch)
    assert torch.equal(l1, l2), (l1.item(), l2.item())
    assert g1.keys() == g2.keys() and any("hyper_connection" in n for n in g1)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), (
            f"{name}: max abs diff {(g1[name] - g2[name]).abs().max().item():.3e}"
        )


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_fused_ops_rebuild_bitwise(make_config, build_gpt, batch, monkeypatch, dropout):
    """With use_fused_mhc (the compiled backend on CPU) the rebuilt states still give bitwise the plain
    gradients, also with hidden dropout (the fused h_post_bda's in-kernel mask replays from the RNG state)."""
    monkeypatch.setenv("MHC_BACKEND", "compiled")
    # 4 Sinkhorn iterations: the compiled pre unrolls them, and 20 cost seconds of cold compilation per case.
    fast = dict(use_fused_mhc=True, hidden_dropout=dropout, mhc_sinkhorn_iterations=4)
    plain = build_gpt(_config(make_config, recompute=False, **fast), seed=1).train()
    fused = build_gpt(_config(make_config, per_group=2, **fast), seed=1).train()
    fused.load_state_dict(plain.state_dict())
    (l1, g1), (l2, g2) = _loss_and_grads(plain, batch), _loss_and_grads(fused, batch)
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_combines_with_layernorm_and_core_attention_recompute(make_config, build_gpt, batch):
    """ "mhc" with "layernorm" and "core_attn" selective recompute: loss and gradients still equal the plain run."""
    plain = build_gpt(_config(make_config, recompute=False), seed=1)
    both = build_gpt(_config(make_config, per_group=2, modules=("mhc", "layernorm", "core_attn")), seed=1)
    both.load_state_dict(plain.state_dict())
    assert both.decoder.layers[0].recompute_input_layernorm
    (l1, g1), (l2, g2) = _loss_and_grads(plain, batch), _loss_and_grads(both, batch)
    assert torch.equal(l1, l2)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-6, atol=1e-7, msg=name)


def test_failed_forward_leaves_no_open_group(make_config, build_gpt, batch, monkeypatch):
    """A forward that raises inside a group closes it, so the next forward starts clean and still matches."""
    model = build_gpt(_config(make_config, per_group=None), seed=1)
    layer = model.decoder.layers[1]
    original = layer.mlp.forward
    monkeypatch.setattr(layer.mlp, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    assert layer.mhc_recompute_plan.slot.group is None
    monkeypatch.setattr(layer.mlp, "forward", original)
    loss, grads = _loss_and_grads(model, batch)
    assert torch.isfinite(loss) and grads


@pytest.mark.parametrize(
    ("per_group", "kept"),
    [
        (None, [False] * 7),
        (1, [False, True] * 3 + [False]),
        (2, [False, False, False, True, False, False, False]),
    ],
    ids=["chunk", "per-layer", "groups-of-2"],
)
def test_states_inside_groups_are_not_kept(make_config, build_gpt, batch, recompute_states, per_group, kept):
    """After forward only each group's anchor survives among the 7 inner states of a 4-layer block (8 mixes)."""
    made = recompute_states
    model = build_gpt(_config(make_config, per_group=per_group), seed=1)
    out = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    assert len(made) == 8
    assert [not r.expired() for r in made[:-1]] == kept
    out.float().mean().backward()


def test_eval_forward_takes_no_group(make_config, build_gpt, batch, monkeypatch):
    """Under no_grad (evaluation) the layers run the stock path: no recompute group is made."""
    calls = []

    def init(*a, **k):
        calls.append(a)

    monkeypatch.setattr(StreamRecompute, "__init__", init)
    model = build_gpt(_config(make_config), seed=1).eval()
    with torch.no_grad():
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    assert calls == []


def test_config_keeps_mhc_in_recompute_modules(make_config):
    """ "mhc" survives megatron-core's own recompute_modules validation, which does not list it."""
    config = _config(make_config, per_group=2)
    assert (
        config.recompute_modules == ["mhc"] and config.mhc_recompute and config.mhc_recompute_layer_num == 2
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"recompute_modules": ["mhc"]}, "'mhc' needs recompute_granularity='selective', got None"),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["mhc", "mlp"]},
            "cannot be combined with 'mlp'",
        ),
        ({"mhc_recompute_layer_num": 2}, "needs 'mhc' in recompute_modules"),
        (
            {
                "recompute_granularity": "selective",
                "recompute_modules": ["mhc"],
                "mhc_recompute_layer_num": 0,
            },
            "mhc_recompute_layer_num=0: must be None or an integer >= 1",
        ),
    ],
    ids=["no-selective", "with-mlp", "layer-num-without-mhc", "layer-num-zero"],
)
def test_bad_recompute_settings_raise(make_config, overrides, message):
    """Each bad mHC recompute setting is a ValueError naming the field and value."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(n=N, **overrides)


def test_mhc_recompute_needs_mhc(make_config):
    """ "mhc" in recompute_modules without enable_mhc_connections is a ValueError."""
    with pytest.raises(ValueError, match="'mhc' requires enable_mhc_connections=True"):
        make_config(recompute_granularity="selective", recompute_modules=["mhc"])
