"""Single-pass mHC (DeepSeek-V4.1) in megatron-core: the GPT (dense and MoE) and the hybrid stack from
`mhc_single_pass`, the handoff of H_pre between sublayers, its entry and exit, the config's refusals, the
checkpoint names, mHC recompute and full recompute bitwise the plain run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from mhc_core import run_stack  # noqa: E402
from mhc_core.handoff import pack, unpack  # noqa: E402
from mhc_core.module import HyperConnectionModule  # noqa: E402
from suites.unit.megatron.conftest import SEQ, VOCAB  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 4
V41: dict[str, Any] = dict(
    mhc_single_pass=True,
    mhc_variant="megatron_dev",
    mhc_norm_eps_inside_sqrt=True,
    mhc_fp32_coefficients=True,
    mhc_norm_eps=1e-5,
    layernorm_epsilon=1e-5,
    add_bias_linear=False,
    ffn_hidden_size=64,
)
"""DeepSeek-V4.1's numerics (`deepseek_v41`, the model's RMS epsilon in the mapping) in the single-pass form."""
MOE: dict[str, Any] = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2
)


def _gpt(make_config, build_gpt, *, moe=False, layers=2, seed=0, **overrides: Any) -> Any:
    config = make_config(n=N, num_layers=layers, **{**V41, **(MOE if moe else {}), **overrides})
    return build_gpt(config, seed=seed)


def _hybrid(make_config, pattern="*-*E", seed=0, **overrides: Any) -> Any:
    from mhc_core.megatron.gpt import MHCGPTModel
    from mhc_core.megatron.hybrid import hybrid_block_spec

    config = make_config(
        n=N, num_layers=len(pattern), **{**V41, **(MOE if "E" in pattern else {}), **overrides}
    )
    torch.manual_seed(seed)
    return MHCGPTModel(
        config, hybrid_block_spec(config, pattern), vocab_size=VOCAB, max_sequence_length=2 * SEQ
    )


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    ).mean()


def _connections(model: Any) -> list[HyperConnectionModule]:
    return [m for m in model.modules() if isinstance(m, HyperConnectionModule)]


def _record_calls(model: Any) -> list[dict[str, Any]]:
    """Each hyper connection's calls in order: its streams, the H_pre it was given and the one it returned."""
    calls: list[dict[str, Any]] = []
    for hc in _connections(model):

        def hook(module, args, kwargs, out, hc=hc):
            calls.append(
                {
                    "hc": module,
                    "x": args[0],
                    "previous": kwargs["previous_h_pre"],
                    "next": out.next_h_pre,
                    "branch": out.branch_input,
                }
            )

        hc.register_forward_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid"])
def test_each_sublayer_aggregates_with_its_predecessors_h_pre(make_config, build_gpt, batch, kind):
    """Sublayer k's connection is given, bit for bit, the H_pre sublayer k - 1 returned; the first is given the
    identity mix (its branch input is stream 0 exactly); the exit aggregates with the last H_pre."""
    from mhc_core.ops import exit_aggregate

    model = _hybrid(make_config) if kind == "hybrid" else _gpt(make_config, build_gpt, moe=kind == "moe")
    calls = _record_calls(model)
    seen: dict[str, torch.Tensor] = {}
    model.decoder.final_layernorm.register_forward_pre_hook(lambda m, args: seen.setdefault("exit", args[0]))
    carriers: list[torch.Tensor] = []
    model.decoder.layers[-1].register_forward_hook(
        lambda m, args, out: carriers.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    assert len(calls) == 4 and [c["hc"] for c in calls] == _connections(model)
    first = calls[0]
    one_hot = torch.zeros_like(first["previous"])
    one_hot[..., 0] = 1
    assert torch.equal(first["previous"], one_hot) and first["previous"].dtype == torch.float32
    assert torch.equal(first["branch"], first["x"].view(SEQ, -1, N, first["x"].shape[-1] // N)[:, :, 0])
    for k in range(1, len(calls)):
        assert torch.equal(calls[k]["previous"], calls[k - 1]["next"]), (
            f"sublayer {k}: not its predecessor's H_pre"
        )
    x, h_pre = unpack(carriers[-1], N, torch.float32)  # the last layer's output carrier
    assert torch.equal(h_pre, calls[-1]["next"]) and torch.equal(seen["exit"], exit_aggregate(x, h_pre, N))


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_the_decoder_is_the_reference_stack(make_config, build_gpt, batch, kind):
    """The megatron decoder (embedding to final norm) equals `run_stack` of its own hyper connections and
    branches: the same data flow, written once in mhc_core (fp32, to 1e-6 of the largest entry)."""
    model = _hybrid(make_config, "*-*-") if kind == "hybrid" else _gpt(make_config, build_gpt)
    model.eval()
    seen: dict[str, torch.Tensor] = {}
    model.decoder.final_layernorm.register_forward_pre_hook(lambda m, args: seen.setdefault("exit", args[0]))
    with torch.no_grad():
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        h = model.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        mask = batch["attention_mask"]
        branches: list[Any] = []
        for layer in model.decoder.layers:
            inner = layer.inner_layer if kind == "hybrid" else layer
            if kind == "hybrid":
                branches.append(lambda a, layer=layer: layer._branch(a, attention_mask=mask)[0])
            else:
                branches.append(
                    lambda a, inner=inner: inner.self_attention(
                        inner.input_layernorm(a), attention_mask=mask
                    )[0]
                )
                branches.append(lambda a, inner=inner: inner.mlp(inner.pre_mlp_layernorm(a))[0])
        want = run_stack(h, _connections(model), branches)
    err = float((seen["exit"] - want).abs().max() / want.abs().max())
    assert err <= 1e-6, f"decoder vs run_stack: {err:.3e} relative"


def test_the_forms_start_from_the_same_weights(make_config):
    """The hybrid stack under one seed has the same parameters, bit for bit, in both forms (single-pass adds and
    drops none): the functional recipe's V4 twin starts where the V4.1 run does."""
    single, twin = (
        _hybrid(make_config, seed=3).state_dict(),
        _hybrid(make_config, seed=3, mhc_single_pass=False),
    )
    twin_state = twin.state_dict()
    assert single.keys() == twin_state.keys()
    assert all(torch.equal(v, twin_state[k]) for k, v in single.items() if isinstance(v, torch.Tensor))


def test_single_pass_is_not_the_per_sublayer_model(make_config, build_gpt, batch):
    """The same weights in the two forms give different losses (the flag reaches the data flow)."""
    single = _gpt(make_config, build_gpt)
    per_sublayer = _gpt(make_config, build_gpt, mhc_single_pass=False)
    per_sublayer.load_state_dict(single.state_dict())
    with torch.no_grad():
        a, b = _loss(single, batch), _loss(per_sublayer, batch)
    assert abs(float(a) - float(b)) > 1e-4, (float(a), float(b))


@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid"])
def test_every_parameter_gets_a_gradient(make_config, build_gpt, batch, kind):
    """Loss and backward through the handoff: every parameter's gradient is finite and non-zero, the H_pre rows of
    the last sublayer's projection included (they reach the loss through the exit only)."""
    model = _hybrid(make_config) if kind == "hybrid" else _gpt(make_config, build_gpt, moe=kind == "moe")
    _loss(model, batch).backward()
    bad = {
        n: None if p.grad is None else float(p.grad.abs().max())
        for n, p in model.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.abs().max() > 0
    }
    assert not bad, bad
    last = _connections(model)[-1]
    assert bool(last.mapping_proj.weight.grad[:N].abs().sum() > 0)


def test_state_dict_keys_are_the_per_sublayer_models(make_config, build_gpt):
    """Single-pass adds no parameter: its keys are the V4 GPT's without a learned head (a V4.1 checkpoint is a V4
    checkpoint without hc_head)."""
    single = _gpt(make_config, build_gpt)
    v4 = _gpt(make_config, build_gpt, mhc_single_pass=False, mhc_learned_contraction=True)
    head = {"decoder.hc_head_fn", "decoder.hc_head_base", "decoder.hc_head_scale"}
    assert set(single.state_dict()) == set(v4.state_dict()) - head


def test_deepseek_v41_checkpoint_names(make_config, build_gpt):
    """`to_deepseek_v4(variant="deepseek_v41")` writes V4's checkpoint names (as vLLM's V4.1 loader reads them)
    and no head; a head under V4.1 is refused; the names come back unchanged."""
    from mhc_core.megatron.deepseek_v4_names import from_deepseek_v4, to_deepseek_v4

    state = _gpt(make_config, build_gpt).state_dict()
    ckpt = to_deepseek_v4(state, variant="deepseek_v41", names="checkpoint")
    assert set(ckpt) == {
        f"layers.{i}.hc_{s}_{p}" for i in range(2) for s in ("attn", "ffn") for p in ("fn", "base", "scale")
    }
    back = from_deepseek_v4(ckpt)
    assert all(torch.equal(back[k], state[k]) for k in back) and len(back) == 20
    with pytest.raises(ValueError, match="hc_head_fn is a learned exit head"):
        to_deepseek_v4({**state, "decoder.hc_head_fn": torch.zeros(4, 128)}, variant="deepseek_v41")


@pytest.mark.parametrize(
    "field,value,error,match",
    [
        (
            "mtp_num_layers",
            1,
            NotImplementedError,
            "multi-token prediction is not defined with mhc_single_pass",
        ),
        ("mhc_learned_contraction", True, ValueError, "there is no learned exit head"),
        ("mhc_h_res_constraint", "none", ValueError, "mhc_h_res_constraint='none'.*needs 'sinkhorn'"),
        ("mhc_single_pass", "yes", ValueError, "mhc_single_pass='yes': must be True or False"),
        ("mhc_norm_eps", -1.0, ValueError, "mhc_norm_eps=-1.0: must be a finite number >= 0"),
    ],
)
def test_what_single_pass_refuses_is_named(make_config, field, value, error, match):
    """MTP (no published V4.1 form), a learned head, unconstrained H_res and bad values: errors naming the field."""
    with pytest.raises(error, match=match):
        make_config(n=N, **{**V41, field: value})


def test_full_recompute_needs_the_single_pass_form(make_config):
    """Full recompute stays refused in the per-sublayer form (as upstream main) and names the way out."""
    with pytest.raises(NotImplementedError, match="mhc_single_pass=True, whose handoff travels"):
        make_config(n=N, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    make_config(n=N, **V41, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def test_the_config_names_deepseek_v41(make_config):
    """The V4.1 flags resolve to the named configuration, with the model's RMS epsilon in the mapping."""
    from mhc_core.config import HyperConnectionConfig
    from mhc_core.variants import configuration_name

    config = make_config(n=N, **V41)
    assert configuration_name(config.mhc_numerics) == "deepseek_v41"
    hc = HyperConnectionConfig.from_transformer_config(config)
    assert hc.norm_eps == 1e-5 and hc.form == "single_pass"


def _loss_and_grads(model: Any, batch: dict[str, torch.Tensor], seed: int = 11) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = _loss(model, batch)
    loss.backward()
    return loss.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


RECOMPUTE = {
    "mhc-chunk": dict(recompute_granularity="selective", recompute_modules=["mhc"]),
    "mhc-per-layer": dict(
        recompute_granularity="selective", recompute_modules=["mhc"], mhc_recompute_layer_num=1
    ),
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_recompute_equals_the_plain_run(make_config, build_gpt, batch, kind, recompute, dropout):
    """mHC recompute (which upstream refuses for V4.1) and full recompute, with the handoff crossing every group
    and checkpoint: loss and every gradient bitwise the plain run's, with hidden dropout replayed."""

    def build(**extra: Any) -> Any:
        kw = dict(hidden_dropout=dropout, **extra)
        if kind == "hybrid":
            return _hybrid(make_config, "*-*-", seed=1, **kw).train()
        return _gpt(make_config, build_gpt, seed=1, **kw).train()

    plain, recomputed = build(), build(**RECOMPUTE[recompute])
    recomputed.load_state_dict(plain.state_dict())
    want_loss, want = _loss_and_grads(plain, batch)
    loss, got = _loss_and_grads(recomputed, batch)
    assert torch.equal(loss, want_loss), (float(loss), float(want_loss))
    assert got.keys() == want.keys()
    different = {n: float((got[n] - want[n]).abs().max()) for n in want if not torch.equal(got[n], want[n])}
    assert not different, different


def test_mhc_recompute_keeps_only_the_anchor(make_config, build_gpt, batch, recompute_states):
    """Under mHC recompute the carriers a group produces are dropped after forward (only its anchor is kept)."""
    model = _gpt(make_config, build_gpt, **RECOMPUTE["mhc-chunk"]).train()
    loss = _loss(model, batch)
    assert len(recompute_states) == 4
    kept = [not r.expired() for r in recompute_states[:-1]]
    loss.backward()
    assert kept == [False] * 3, kept


@pytest.mark.parametrize("streams_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_carrier_round_trip_is_bitwise(streams_dtype):
    """`pack` / `unpack` give back the streams and an fp32 mix bit for bit, and their gradients too (behind bf16
    streams the mix's bytes take 2n channels, not a rounding)."""
    s = torch.randn(3, 2, 16, dtype=streams_dtype, requires_grad=True)
    m = torch.rand(3, 2, 4, dtype=torch.float32, requires_grad=True)
    carrier = pack(s, m)
    assert (
        carrier.shape[-1] == 16 + (8 if streams_dtype == torch.bfloat16 else 4)
        and carrier.dtype == streams_dtype
    )
    s2, m2 = unpack(carrier, 4, torch.float32)
    assert torch.equal(s2, s) and torch.equal(m2, m)
    gs, gm = torch.randn_like(s2), torch.rand(3, 2, 4) * 1e-30  # tiny mix gradients: no bf16 could hold them
    torch.autograd.backward([s2, m2], [gs, gm])
    assert torch.equal(s.grad, gs) and torch.equal(m.grad, gm)


def test_unpack_names_a_carrier_of_the_wrong_width():
    """A carrier whose width is not n*C + k: a ValueError with its shape, n and k."""
    with pytest.raises(ValueError, match=r"carrier \[3, 2, 13\] .* n = 4 and k = 4"):
        unpack(torch.zeros(3, 2, 13), 4, torch.float32)
