"""The block boundary: expansion in the pre_process chunk, contraction in the post_process chunk
(also without a final layernorm and with zero layers), n*C everywhere in between."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402

from mhc_core import contract, expand  # noqa: E402
from mhc_core.megatron import (  # noqa: E402
    HyperConnectionTransformerBlock,
    MHCGPTModel,
    get_gpt_layer_local_spec,
)

pytestmark = pytest.mark.usefixtures("megatron_world")
N = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _block(config, num_layers, *, pre, post, final_norm=True, seed=0):
    """A chunk of `num_layers` mHC layers (with a final layernorm when `final_norm`), on `DEVICE`."""
    spec = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec(enable_mhc=True)] * num_layers,
        layer_norm=WrappedTorchNorm if final_norm else None,
    )
    torch.manual_seed(seed)
    return HyperConnectionTransformerBlock(config, spec, pre_process=pre, post_process=post).to(DEVICE)


def _run(block, x, mask):
    """Forward a chunk: `x` is the argument of a pre_process chunk, else the received tensor."""
    if not block.pre_process:
        block.set_input_tensor(x)
        x = None
    return block(hidden_states=x, attention_mask=mask)


@pytest.fixture
def x(dims):
    """An embedding output `[s, b, C]`."""
    return torch.randn(dims.s, dims.b, dims.c, generator=torch.Generator().manual_seed(11)).to(DEVICE)


@pytest.fixture
def mask(batch):
    return batch["attention_mask"]


@pytest.mark.parametrize(
    ("pre", "post", "width"),
    [(True, True, 1), (True, False, N), (False, True, 1), (False, False, N)],
    ids=["pre-post", "pre-only", "post-only", "middle"],
)
def test_chunk_output_width(make_config, x, mask, dims, pre, post, width):
    """Only the post_process chunk returns [s, b, C]; every other chunk returns [s, b, n*C]."""
    block = _block(make_config(n=N), 2, pre=pre, post=post)
    inp = x if pre else expand(x, N)
    assert _run(block, inp, mask).shape == (dims.s, dims.b, width * dims.c)


def test_two_chunks_compose_to_the_whole_block(make_config, x, mask):
    """A pre_process chunk then a post_process chunk (same weights) reproduce the single block bitwise."""
    config = make_config(n=N)
    whole = _block(config, 2, pre=True, post=True)
    first, last = _block(config, 1, pre=True, post=False), _block(config, 1, pre=False, post=True)
    first.layers[0].load_state_dict(whole.layers[0].state_dict())
    last.layers[0].load_state_dict(whole.layers[1].state_dict())
    last.final_layernorm.load_state_dict(whole.final_layernorm.state_dict())
    assert torch.equal(_run(last, _run(first, x, mask), mask), _run(whole, x, mask))


def test_contraction_precedes_the_final_layernorm(make_config, x, mask):
    """The final layernorm receives the mean of the streams [s, b, C]."""
    config = make_config(n=N)
    whole = _block(config, 2, pre=True, post=True)
    streams = _block(config, 2, pre=True, post=False)
    streams.load_state_dict(whole.state_dict(), strict=False)
    expected = whole.final_layernorm(contract(_run(streams, x, mask), N))
    assert torch.equal(_run(whole, x, mask), expected)


def test_contraction_without_final_layernorm(make_config, x, mask):
    """post_process chunk without a final layernorm still contracts: output is the mean of the streams."""
    config = make_config(n=N)
    block = _block(config, 2, pre=True, post=True, final_norm=False)
    streams = _block(config, 2, pre=True, post=False, final_norm=False)
    assert block.final_layernorm is None
    assert torch.equal(_run(block, x, mask), contract(_run(streams, x, mask), N))


@pytest.mark.parametrize("final_norm", [True, False], ids=["final-norm", "no-final-norm"])
def test_zero_layer_post_process_chunk_contracts(make_config, x, mask, dims, final_norm):
    """A post_process chunk with zero transformer layers contracts the received [s, b, n*C] to [s, b, C]."""
    block = _block(make_config(n=N), 0, pre=False, post=True, final_norm=final_norm)
    streams = expand(x, N) + torch.arange(N, device=DEVICE).repeat_interleave(dims.c)  # distinct streams
    out = _run(block, streams, mask)
    mean = contract(streams, N)
    assert torch.equal(out, block.final_layernorm(mean) if final_norm else mean)


def test_zero_layer_pre_process_chunk_expands(make_config, x, mask):
    """A pre_process chunk with zero transformer layers sends n identical copies [s, b, n*C]."""
    block = _block(make_config(n=N), 0, pre=True, post=False)
    assert torch.equal(_run(block, x, mask), expand(x, N))


def test_gpt_without_final_layernorm_feeds_c_wide_output_layer(make_config, batch, gpt_logits, dims):
    """A GPT whose decoder has no final layernorm hands [s, b, C] (not [s, b, n*C]) to the output layer."""
    spec = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec(enable_mhc=True)] * 2, layer_norm=None
    )
    model = MHCGPTModel(make_config(n=N), spec, vocab_size=dims.v, max_sequence_length=2 * dims.s).to(DEVICE)
    seen = []
    model.output_layer.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    assert gpt_logits(model, batch).shape == (dims.b, dims.s, dims.v)
    assert seen == [(dims.s, dims.b, dims.c)]


def test_block_with_mhc_off_is_the_stock_block(make_config, x, mask):
    """With mHC off the block is megatron-core's: same parameters and bitwise the same [s, b, C] output
    as a stock TransformerBlock built from the same seed."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as stock_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    spec = TransformerBlockSubmodules(layer_specs=[stock_spec()] * 2, layer_norm=WrappedTorchNorm)
    torch.manual_seed(0)
    block = HyperConnectionTransformerBlock(make_config(), spec).to(DEVICE)
    torch.manual_seed(0)
    stock = TransformerBlock(make_config(), spec).to(DEVICE)
    ours_sd, stock_sd = block.state_dict(), stock.state_dict()
    assert ours_sd.keys() == stock_sd.keys()
    assert all(torch.equal(v, stock_sd[k]) for k, v in ours_sd.items() if isinstance(v, torch.Tensor))
    out = block(hidden_states=x, attention_mask=mask)
    assert out.shape == x.shape
    assert torch.equal(out, stock(hidden_states=x, attention_mask=mask))


@pytest.mark.parametrize(
    ("pre", "layers", "expanded", "what"),
    [
        (
            False,
            0,
            False,
            r"a chunk after the first, n = 3, C = 32, 0 layers\): its input must be \[s, b, n\*C\]",
        ),
        (
            False,
            1,
            False,
            r"a chunk after the first, n = 3, C = 32, 1 layers\): its input must be \[s, b, n\*C\]",
        ),
        (True, 1, True, r"the pre_process chunk, n = 3, C = 32, 1 layers\): its input must be \[s, b, C\]"),
    ],
    ids=["zero-layer-gets-C", "later-gets-C", "pre-gets-nC"],
)
def test_a_chunk_given_the_wrong_width_names_its_role(make_config, x, mask, pre, layers, expanded, what):
    """A chunk fed the other width ([s, b, C] vs [s, b, n*C]) raises naming its role, n, C and the shape,
    also with zero layers (which used to contract or pass the wrong width on)."""
    block = _block(make_config(n=N), layers, pre=pre, post=True, final_norm=False)
    given = expand(x, N) if expanded else x
    with pytest.raises(
        ValueError,
        match=rf"HyperConnectionTransformerBlock \({what}.*got \[{', '.join(map(str, given.shape))}\]",
    ):
        _run(block, given, mask)


class TestLearnedContraction:
    """megatron_dev's learned block exit (hc_head_fn / hc_head_base / hc_head_scale)."""

    @pytest.fixture
    def config(self, make_config):
        return make_config(n=N, mhc_variant="megatron_dev", mhc_learned_contraction=True)

    def test_parameters_live_on_the_post_process_chunk(self, config):
        """hc_head_fn [n, n*C], hc_head_base [n], hc_head_scale [1] exist only in the post_process chunk."""
        post, pre = _block(config, 1, pre=True, post=True), _block(config, 1, pre=True, post=False)
        shapes = {k: tuple(v.shape) for k, v in post.state_dict().items() if k.startswith("hc_head")}
        assert shapes == {
            "hc_head_fn": (N, N * config.hidden_size),
            "hc_head_base": (N,),
            "hc_head_scale": (1,),
        }
        assert not any(k.startswith("hc_head") for k in pre.state_dict())

    def test_output_is_the_learned_contraction(self, config, x, mask):
        """The final layernorm receives learned_contract(streams), and hc_head_fn gets a gradient."""
        from mhc_core import learned_contract

        whole = _block(config, 1, pre=True, post=True)
        streams = _block(config, 1, pre=True, post=False)
        streams.load_state_dict(whole.state_dict(), strict=False)
        h = _run(streams, x, mask)
        mixed = learned_contract(
            h, whole.hc_head_fn, whole.hc_head_base, whole.hc_head_scale, N, config.layernorm_epsilon
        )
        out = _run(whole, x, mask)
        assert torch.equal(out, whole.final_layernorm(mixed))
        out.square().mean().backward()
        assert whole.hc_head_fn.grad is not None and whole.hc_head_fn.grad.abs().max() > 0
