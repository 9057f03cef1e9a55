"""Multi-token prediction with mHC (`mhc_core.megatron.mtp`): upstream dev's data flow, where each depth takes the
decoder's pre-contraction streams, adds `e_proj` of the next tokens' embedding to `h_proj` of each normalised
stream, runs its inner mHC layer on n streams, hands those streams to the next depth and its own contraction to
the shared lm head; every numeric variant, dev's state-dict keys."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from mhc_core.megatron.mtp import HyperConnectionMTPBlock, HyperConnectionMTPLayer, tracked_mtp_losses  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 4


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    ).mean()


def _inner(layer: Any) -> Any:
    """The depth's inner transformer layer (`transformer_layer` in megatron-core 0.16, `mtp_model_layer` later)."""
    return getattr(layer, "mtp_model_layer", None) or layer.transformer_layer


@pytest.mark.parametrize("variant", ["megatron_main", "megatron_dev+learned_exit", "paper"])
def test_every_parameter_of_an_mhc_mtp_gpt_gets_a_gradient(make_config, build_gpt, batch, variant):
    """An mHC GPT with two MTP depths trains: finite loss, a finite MTP loss per depth, and every parameter (each
    depth's e_proj, h_proj, norms, inner hyper connections and, with the learned exit, its hc_head) a finite,
    non-zero gradient."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    name, _, option = variant.partition("+")
    config = make_config(
        n=N, mhc_variant=name, mhc_learned_contraction=option == "learned_exit", mtp_num_layers=2
    )
    model = build_gpt(config)
    assert isinstance(model.mtp, HyperConnectionMTPBlock)
    assert all(isinstance(layer, HyperConnectionMTPLayer) for layer in model.mtp.layers)
    MTPLossLoggingHelper.tracker.clear()
    loss = _loss(model, batch)
    loss.backward()
    tracked = tracked_mtp_losses()
    assert (
        tracked is not None and torch.isfinite(loss) and tracked.shape == (2,) and bool((tracked > 0).all())
    ), (float(loss), tracked)
    bad = {
        n: None if p.grad is None else float(p.grad.abs().max())
        for n, p in model.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.abs().max() > 0
    }
    assert not bad, f"parameters without a finite, non-zero gradient: {bad}"


def test_state_dict_keys_are_devs(make_config, build_gpt):
    """With mHC each depth has `e_proj` and `h_proj` (C x C) and no `eh_proj`; with the learned exit its own
    `hc_head_fn [n, n*C]`, `hc_head_base [n]`, `hc_head_scale [1]`, as upstream dev names them."""
    model = build_gpt(
        make_config(n=N, mhc_variant="megatron_dev", mhc_learned_contraction=True, mtp_num_layers=1)
    )
    sd = model.state_dict()
    c = model.config.hidden_size
    assert sd["mtp.layers.0.e_proj.weight"].shape == (c, c)
    assert sd["mtp.layers.0.h_proj.weight"].shape == (c, c)
    assert sd["mtp.layers.0.hc_head_fn"].shape == (N, N * c)
    assert sd["mtp.layers.0.hc_head_base"].shape == (N,) and sd["mtp.layers.0.hc_head_scale"].shape == (1,)
    assert not [k for k in sd if "eh_proj" in k]
    stock = build_gpt(make_config(mtp_num_layers=1)).state_dict()
    assert "mtp.layers.0.eh_proj.weight" in stock and not [
        k for k in stock if "e_proj." in k and "eh_proj" not in k
    ]


def test_each_depth_runs_on_the_streams(make_config, build_gpt, batch, dims):
    """Depth 1's inner layer gets `e_proj(enorm(emb(next tokens)))` broadcast over the streams plus
    `h_proj(hnorm(stream))` of the decoder's uncontracted streams; depth 2's the same from depth 1's output
    streams; each depth's lm-head input is `final_layernorm(contract(its streams))` (learned contraction here)."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    model = build_gpt(
        make_config(n=N, mhc_variant="megatron_dev", mhc_learned_contraction=True, mtp_num_layers=2)
    ).eval()
    seen: dict[str, list[torch.Tensor]] = {"exit": [], "inner_in": [], "inner_out": [], "block_out": []}
    exit_ = model.decoder._exit

    def exit_keeping_the_streams(x: torch.Tensor) -> torch.Tensor:
        seen["exit"].append(x)
        return exit_(x)

    model.decoder._exit = exit_keeping_the_streams
    for layer in model.mtp.layers:
        _inner(layer).register_forward_pre_hook(
            lambda m, a, k: seen["inner_in"].append(k["hidden_states"]), with_kwargs=True
        )
        _inner(layer).register_forward_hook(lambda m, a, out: seen["inner_out"].append(out[0]))
    model.mtp.register_forward_hook(lambda m, a, out: seen["block_out"].append(out))
    s, b, c = dims.s, dims.b, dims.c
    with torch.no_grad():
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        streams = seen["exit"][0]
        assert streams.shape == (s, b, N * c)
        ids, pos = batch["input_ids"], batch["position_ids"]
        for depth, layer in enumerate(model.mtp.layers):
            ids, _ = roll_tensor(ids, shifts=-1, dims=-1)
            pos, _ = roll_tensor(pos, shifts=-1, dims=-1)
            emb = layer.enorm(model.embedding(input_ids=ids, position_ids=pos))  # [s, b, C]
            hn = layer.hnorm(streams.view(s, b, N, c))
            want = emb @ layer.e_proj.weight.t()
            want = (want.unsqueeze(2) + hn @ layer.h_proj.weight.t()).reshape(s, b, N * c)
            got = seen["inner_in"][depth]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"depth {depth + 1}: inner input")
            streams = seen["inner_out"][depth]
            assert streams.shape == (s, b, N * c)
            head_in = layer.final_layernorm(layer.contract_streams(streams))
            torch.testing.assert_close(
                seen["block_out"][0][(depth + 1) * s : (depth + 2) * s], head_in, rtol=0, atol=0
            )


def test_mhc_off_is_the_stock_mtp(make_config, build_gpt):
    """With mHC off, the model is a stock `GPTModel` with megatron-core's own MTP block and layers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    config = make_config(mtp_num_layers=1)
    ours = build_gpt(config)
    assert type(ours) is GPTModel
    assert not isinstance(ours.mtp, HyperConnectionMTPBlock)
    assert [type(layer) for layer in ours.mtp.layers] == [MultiTokenPredictionLayer]


def test_the_block_without_the_decoder_streams_raises(make_config, build_gpt, batch):
    """The MTP block called outside `MHCGPTModel` (no decoder streams) says what it needs."""
    model = build_gpt(make_config(n=N, mtp_num_layers=1))
    x = torch.zeros(batch["input_ids"].shape[1], batch["input_ids"].shape[0], model.config.hidden_size)
    with pytest.raises(RuntimeError, match=r"no decoder streams \[s, b, n\*C\]"):
        model.mtp(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            hidden_states=x,
            attention_mask=batch["attention_mask"],
            embedding=model.embedding,
        )


def test_a_depth_given_one_stream_raises(make_config, build_gpt, dims):
    """A depth's contraction given `[s, b, C]` instead of the streams names n, C and the shape."""
    model = build_gpt(make_config(n=N, mtp_num_layers=1))
    with pytest.raises(
        ValueError,
        match=rf"n = {N}, C = {dims.c}.*last dim {N * dims.c}; got \[{dims.s}, {dims.b}, {dims.c}\]",
    ):
        model.mtp.layers[0].contract_streams(torch.zeros(dims.s, dims.b, dims.c))
