"""A megatron-core GPT with mHC on the local spec, on CPU: forward/backward, gradients, state dict,
and bitwise equality with the stock model when mHC is off."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from mhc_core.megatron import MHCGPTModel  # noqa: E402
from mhc_core.megatron import get_gpt_layer_local_spec as mhc_local_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")
STREAMS = [pytest.param(n, id=f"n{n}") for n in (1, 2, 4)]
HC_PARAMS = ("mapping_proj.weight", "alpha_pre", "alpha_post", "alpha_res", "bias")


def _loss(model, batch):
    """Mean token loss `[]` of a GPT forward with labels."""
    return model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    ).mean()


def _mhc_grads(model, batch):
    """Gradients of the mHC parameters after one backward, away from the init point (alphas 1,
    random bias) so that no gradient is tiny by accident."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hyper_connection.alpha" in name:
                p.fill_(1.0)
            elif name.endswith("hyper_connection.bias"):
                p.normal_()
    _loss(model, batch).backward()
    return {name: p.grad for name, p in model.named_parameters() if "hyper_connection" in name}


@pytest.mark.parametrize("n", STREAMS)
def test_forward_backward_shapes(make_config, build_gpt, batch, gpt_logits, dims, n):
    """mHC GPT on the local spec: logits [b, s, V] and a finite loss gradient on CPU."""
    model = build_gpt(make_config(n=n))
    out = gpt_logits(model, batch)
    assert out.shape == (dims.b, dims.s, dims.v)
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("n", STREAMS)
def test_every_mhc_parameter_gets_a_finite_gradient(make_config, build_gpt, batch, n):
    """Every mHC parameter of every layer receives a finite gradient."""
    model = build_gpt(make_config(n=n))
    grads = _mhc_grads(model, batch)
    assert len(grads) == 2 * 5 * model.config.num_layers
    bad = [name for name, g in grads.items() if g is None or not torch.isfinite(g).all()]
    assert not bad, f"missing or non-finite gradients: {bad}"


def _structurally_zero(name: str, n: int, num_layers: int) -> bool:
    """alpha_res gradients that vanish by the math (exactly, or up to Sinkhorn's residual error):
    n = 1: H_res is the 1x1 doubly stochastic matrix [1] whatever the logits;
    first layer, attention: its input streams are identical copies (expansion), and a
    row-stochastic H_res maps identical streams to themselves;
    last layer, MLP: the mean contraction of a column-stochastic mix equals the mean of its input."""
    if not name.endswith("alpha_res"):
        return False
    first = name.startswith("decoder.layers.0.self_attention_hyper_connection")
    last = name.startswith(f"decoder.layers.{num_layers - 1}.mlp_hyper_connection")
    return n == 1 or first or last


@pytest.mark.parametrize("n", STREAMS)
def test_every_mhc_parameter_gets_a_nonzero_gradient(make_config, build_gpt, batch, n):
    """Every mHC parameter's gradient is non-zero, except the alpha_res gradients that vanish by the math."""
    config = make_config(n=n)
    grads = _mhc_grads(build_gpt(config), batch)
    zero = [
        name
        for name, g in grads.items()
        if not _structurally_zero(name, n, config.num_layers) and not bool(g.abs().max() > 0)
    ]
    assert not zero, f"zero gradients: {zero}"


def test_state_dict_keys_are_upstream_names(make_config, build_gpt):
    """The mHC state-dict keys are exactly upstream's decoder.layers.<i>.{self_attention,mlp}_hyper_connection.*."""
    config = make_config(n=4)
    keys = {k for k in build_gpt(config).state_dict() if "hyper_connection" in k}
    expected = {
        f"decoder.layers.{i}.{slot}.{p}"
        for i in range(config.num_layers)
        for slot in ("self_attention_hyper_connection", "mlp_hyper_connection")
        for p in HC_PARAMS
    }
    assert keys == expected


def test_state_dict_non_mhc_keys_match_stock(make_config, build_gpt):
    """Apart from the mHC keys, the state dict has exactly the stock GPTModel's keys."""
    mhc = {k for k in build_gpt(make_config(n=4)).state_dict() if "hyper_connection" not in k}
    assert mhc == set(build_gpt(make_config()).state_dict())


def test_mhc_parameter_shapes(make_config, build_gpt, dims):
    """mapping_proj.weight [N, n*C], alphas [1], bias [N] with N = n*n + 2n."""
    n = 4
    layer = build_gpt(make_config(n=n)).decoder.layers[0]
    big_n = n * n + 2 * n
    for hc in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
        assert hc.mapping_proj.weight.shape == (big_n, n * dims.c)
        assert hc.bias.shape == (big_n,)
        assert all(getattr(hc, a).shape == (1,) for a in ("alpha_pre", "alpha_post", "alpha_res"))


@pytest.mark.parametrize("exit_", ["mean", "learned"])
def test_sharded_state_dict_holds_every_parameter(make_config, build_gpt, exit_):
    """megatron's sharded_state_dict (distributed checkpointing) includes every parameter, the mHC ones and the
    learned exit's `decoder.hc_head_*` (which released megatron-core's block leaves out of its own)."""
    learned = {"mhc_variant": "megatron_dev", "mhc_learned_contraction": True} if exit_ == "learned" else {}
    model = build_gpt(make_config(n=2, **learned))
    sharded = set(model.sharded_state_dict())
    params = {name for name, _ in model.named_parameters()}
    assert params <= sharded, sorted(params - sharded)
    assert {k for k in sharded if "hyper_connection" in k} == {
        k for k in model.state_dict() if "hyper_connection" in k
    }
    assert ("decoder.hc_head_fn" in sharded) == (exit_ == "learned")


def _assert_same_state(ours, stock) -> None:
    """The same state-dict keys in the same order, and bitwise the same tensors."""
    for (k1, v1), (k2, v2) in zip(ours.state_dict().items(), stock.state_dict().items(), strict=True):
        assert k1 == k2, (k1, k2)
        assert (v1 is None and v2 is None) or torch.equal(v1, v2), k1


def test_mhc_off_is_bitwise_the_stock_model(make_config, build_gpt, batch, gpt_logits, device):
    """With mHC off, build_gpt_model equals a stock GPTModel built with the same seed: parameters and logits bitwise."""
    config = make_config()
    ours = build_gpt(config, seed=3)
    torch.manual_seed(3)
    stock = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16).to(device)
    _assert_same_state(ours, stock)
    assert torch.equal(gpt_logits(ours, batch), gpt_logits(stock, batch))


def test_mhc_gpt_model_with_flag_off_is_bitwise_the_stock_model(make_config, batch, gpt_logits, device):
    """MHCGPTModel with mHC off builds the stock block: same parameters and logits as GPTModel, bitwise."""
    config, spec = make_config(), get_gpt_layer_local_spec()
    torch.manual_seed(5)
    ours = MHCGPTModel(config, spec, vocab_size=64, max_sequence_length=16).to(device)
    torch.manual_seed(5)
    stock = GPTModel(config, spec, vocab_size=64, max_sequence_length=16).to(device)
    _assert_same_state(ours, stock)
    assert torch.equal(gpt_logits(ours, batch), gpt_logits(stock, batch))


def test_state_dict_roundtrip_reproduces_logits(make_config, build_gpt, batch, gpt_logits):
    """An mHC state dict loads (strict) into a freshly built model and reproduces its logits exactly."""
    config = make_config(n=4)
    source = build_gpt(config, seed=1)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if "hyper_connection" in name:
                p.add_(torch.randn_like(p))
    target = build_gpt(config, seed=2)
    assert not torch.equal(gpt_logits(source, batch), gpt_logits(target, batch))
    target.load_state_dict(source.state_dict(), strict=True)
    assert torch.equal(gpt_logits(source, batch), gpt_logits(target, batch))


def test_model_builds_decoder_once_as_mhc_block(make_config):
    """MHCGPTModel's decoder is the mHC block, and the GPTModel module's block name is restored afterwards."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mhc_core.megatron import HyperConnectionTransformerBlock

    model = MHCGPTModel(
        make_config(n=2), mhc_local_spec(enable_mhc=True), vocab_size=64, max_sequence_length=16
    )
    assert type(model.decoder) is HyperConnectionTransformerBlock
    assert gpt_model.TransformerBlock is TransformerBlock


def test_stock_layer_spec_with_mhc_on_is_rejected(make_config):
    """MHCGPTModel with config.enable_mhc_connections and a stock TransformerLayer spec raises ValueError."""
    with pytest.raises(ValueError, match=re.escape("layers[0] is a TransformerLayer")):
        MHCGPTModel(make_config(n=2), get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def test_rope_model_runs(make_config, build_gpt, batch, gpt_logits, dims):
    """mHC GPT with rotary position embeddings runs forward on CPU."""
    out = gpt_logits(build_gpt(make_config(n=2), position_embedding_type="rope"), batch)
    assert out.shape == (dims.b, dims.s, dims.v)


def test_forward_backward_schedule_runs(make_config, build_gpt, batch):
    """megatron-core's forward_backward_func (no pipelining) trains the mHC GPT for two micro-batches."""
    model = build_gpt(make_config(n=2))

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch, batch]),
        model=[model],
        num_microbatches=2,
        seq_length=batch["input_ids"].shape[1],
        micro_batch_size=batch["input_ids"].shape[0],
        forward_only=False,
    )
    assert len(losses) == 2 and all(torch.isfinite(d["lm loss"]) for d in losses)
    assert all(p.grad is not None for n, p in model.named_parameters() if "hyper_connection" in n)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"vocab_size": 0}, r"vocab_size=0 must be an integer >= 1"),
        ({"max_sequence_length": "64"}, r"max_sequence_length='64' must be an integer >= 1"),
        (
            {"vp_stage": 5},
            r"vp_stage=5 must be None or an integer in \[0, virtual_pipeline_model_parallel_size=1\)",
        ),
    ],
    ids=["vocab-0", "seq-str", "vp-stage-without-vpp"],
)
def test_build_gpt_model_names_a_bad_size(make_config, kw, match):
    """A vocab_size or max_sequence_length that is not an integer >= 1, or a vp_stage the config has no
    virtual stage for, is refused by name before megatron sees it."""
    from mhc_core.megatron.gpt import build_gpt_model

    with pytest.raises(ValueError, match=match):
        build_gpt_model(make_config(n=2), **({"vocab_size": 64, "max_sequence_length": 16} | kw))
