"""mHC with MoE MLPs (megatron-core's `MoELayer`, local experts): upstream dev's data flow, where the MLP-side
hyper connection aggregates the n streams, the router and the experts see one stream `[s, b, C]`, and the n-stream
update follows as for a dense MLP; every numeric variant, both token dispatchers, the router's aux loss kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from mhc_core.megatron import HyperConnectionTransformerLayer  # noqa: E402

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
"""4 local experts, top-2 (upstream's MoE recipes run without linear biases)."""


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    ).mean()


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("variant", ["megatron_main", "megatron_dev", "paper"])
def test_every_parameter_of_an_mhc_moe_gpt_gets_a_gradient(
    make_config, build_gpt, batch, variant, dispatcher
):
    """An mHC GPT whose every MLP is an MoE trains: finite loss, and every parameter (the router, each expert, the
    two hyper connections of each layer) a finite, non-zero gradient."""
    config = make_config(n=N, mhc_variant=variant, moe_token_dispatcher_type=dispatcher, **MOE)
    model = build_gpt(config)
    assert all(
        isinstance(layer, HyperConnectionTransformerLayer) and layer.is_moe_layer
        for layer in model.decoder.layers
    )
    loss = _loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss)
    bad = {
        n: None if p.grad is None else float(p.grad.abs().max())
        for n, p in model.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.abs().max() > 0
    }
    assert not bad, f"parameters without a finite, non-zero gradient: {bad}"


def test_the_router_and_experts_see_the_aggregated_stream(make_config, build_gpt, batch, dims):
    """The MoE layer's input is the pre-MLP norm of the MLP hyper connection's aggregate, `[s, b, C]`; the MLP
    sublayer's output is that connection's `post_residual_bda` of the MoE output, `[s, b, n*C]`, bit for bit."""
    model = build_gpt(make_config(n=N, **MOE)).eval()
    layer = model.decoder.layers[0]
    seen: dict[str, Any] = {}

    # The model's own forward's values (the first call each hook sees; the checks below call the modules again).
    def first_moe_input(module, args, out):
        seen.setdefault("moe_in", args[0])

    def first_layer_input(module, args, kwargs):
        seen.setdefault("layer_in", kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    layer.mlp.register_forward_hook(first_moe_input)
    layer.register_forward_pre_hook(first_layer_input, with_kwargs=True)
    with torch.no_grad():
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        x = seen["layer_in"]
        assert x.shape == (dims.s, dims.b, N * dims.c)
        after_attention, _ = layer._forward_attention(x, attention_mask=batch["attention_mask"])
        got = layer._forward_mlp(after_attention)
        hc = layer.mlp_hyper_connection
        aggregated, h_res, h_post, residual = hc(after_attention)
        moe_in = layer.pre_mlp_layernorm(aggregated)
        want = hc.post_residual_bda(h_res, residual, h_post, layer.mlp(moe_in), layer.hidden_dropout, False)
    assert seen["moe_in"].shape == (dims.s, dims.b, dims.c)
    assert torch.equal(seen["moe_in"], moe_in)
    assert got.shape == (dims.s, dims.b, N * dims.c)
    assert torch.equal(got, want), float((got - want).abs().max())


def test_the_two_dispatchers_give_the_same_model(make_config, build_gpt, batch):
    """allgather and alltoall route the same tokens to the same experts: one model's weights in the other give
    the same loss and gradients within fp32 rounding (eval-free: dropout is 0)."""
    models = [
        build_gpt(make_config(n=N, moe_token_dispatcher_type=d, **MOE)) for d in ("allgather", "alltoall")
    ]
    models[1].load_state_dict(models[0].state_dict())
    grads = []
    losses = []
    for m in models:
        loss = _loss(m, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    worst = {
        name: float((grads[1][name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        for name, g in grads[0].items()
    }
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


def test_the_router_aux_loss_reaches_the_router_through_mhc(make_config, build_gpt, batch):
    """With `moe_aux_loss_coeff` > 0 the load-balancing loss is tracked per MoE layer and adds to the router's
    gradient (it rides on the MoE output through the n-stream update, so a layer that dropped it would not)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    router_grads = []
    for coeff in (0.0, 1.0):
        clear_aux_losses_tracker()
        model = build_gpt(make_config(n=N, **{**MOE, "moe_aux_loss_coeff": coeff}))
        _loss(model, batch).backward()
        router_grads.append(model.decoder.layers[0].mlp.router.weight.grad.clone())
        if coeff:
            tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
            assert tracked.shape == (2,) and bool((tracked > 0).all()), tracked
    assert not torch.allclose(router_grads[0], router_grads[1]), (
        "the aux loss added nothing to the router's grad"
    )


def test_state_dict_keys_are_upstreams(make_config, build_gpt):
    """The MoE layer keeps megatron-core's keys (router, local experts) beside upstream's mHC keys."""
    keys = set(build_gpt(make_config(n=N, **MOE)).state_dict())
    for want in (
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.0.mlp_hyper_connection.mapping_proj.weight",
        "decoder.layers.0.self_attention_hyper_connection.bias",
    ):
        assert want in keys, sorted(k for k in keys if "layers.0" in k)


def test_the_a2a_overlap_schedule_is_refused(make_config):
    """The a2a-overlap schedule splits a layer into nodes of its own (upstream dev adds an mHC node there): refused
    with mHC, naming the field."""
    with pytest.raises(NotImplementedError, match="overlap_moe_expert_parallel_comm=True"):
        make_config(n=N, overlap_moe_expert_parallel_comm=True, moe_token_dispatcher_type="alltoall", **MOE)
