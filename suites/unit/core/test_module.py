"""HyperConnectionModule: parameters as upstream, shapes, the pre-norm start, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mhc_core import HyperConnectionConfig, HyperConnectionModule, Variant, expand
from mhc_core import mapping as mhc_mapping

VARIANTS = list(Variant)


def _module(n=4, c=16, **kw) -> HyperConnectionModule:
    return HyperConnectionModule(HyperConnectionConfig(hidden_size=c, num_residual_streams=n, **kw))


class TestParameters:
    """Names, shapes, dtypes and initial values follow upstream Megatron-LM."""

    def test_state_dict_keys_and_shapes(self):
        """mapping_proj.weight [N, n*C], alpha_* [1], bias [N]; nothing else."""
        sd = _module(n=4, c=16).state_dict()
        assert {k: tuple(v.shape) for k, v in sd.items()} == {
            "mapping_proj.weight": (24, 64),
            "alpha_pre": (1,),
            "alpha_post": (1,),
            "alpha_res": (1,),
            "bias": (24,),
        }

    def test_initial_values(self):
        """alphas = gating factor, bias zeros, projection xavier-uniform (within its bound), fp32."""
        torch.manual_seed(0)
        m = _module(n=4, c=16, init_gating_factor=0.05)
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            assert getattr(m, name).item() == pytest.approx(0.05)
        assert torch.equal(m.bias, torch.zeros(24))
        bound = (6.0 / (24 + 64)) ** 0.5
        w = m.mapping_proj.weight
        assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound and w.std() > 0.4 * bound
        assert all(p.dtype == torch.float32 for p in m.parameters())
        assert m.mapping_proj.bias is None

    def test_no_initialization_leaves_zero_projection(self):
        """perform_initialization=False leaves the projection zero."""
        assert torch.equal(_module(perform_initialization=False).mapping_proj.weight, torch.zeros(24, 64))

    def test_sequence_parallel_tags_parameters(self):
        """sequence_parallel=True tags all five parameters for the TP all-reduce."""
        m = _module(sequence_parallel=True)
        assert all(getattr(p, "sequence_parallel", False) for p in m.parameters())

    def test_reads_transformer_config_fields(self):
        """Any object with upstream's mhc_* names configures the module."""

        class Cfg:
            hidden_size = 8
            mhc_num_residual_streams = 2
            mhc_sinkhorn_iterations = 7
            mhc_init_gating_factor = 0.1
            mhc_variant = "megatron_dev"

        m = HyperConnectionModule(Cfg(), layer_number=3)
        assert (m.n, m.hidden_size, m.hc_config.sinkhorn_iterations, m.layer_number) == (2, 8, 7, 3)
        assert m.hc_config.variant is Variant.MEGATRON_DEV


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_forward_and_bda_shapes(variant):
    """forward: [s, b, C], [s, b, n, n], [s, b, n], residual; bda: [s, b, n*C]; grads reach all params."""
    torch.manual_seed(0)
    m = _module(n=4, c=16, variant=variant)
    x = torch.randn(5, 2, 64, requires_grad=True)
    agg, h_res, h_post, residual = m(x)
    assert agg.shape == (5, 2, 16) and h_res.shape == (5, 2, 4, 4) and h_post.shape == (5, 2, 4)
    assert residual is x
    out = m.post_residual_bda(h_res, residual, h_post, (agg * 2, torch.ones(16)))
    assert out.shape == (5, 2, 64)
    out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


class _PreNormSublayer(nn.Module):
    """F(norm(x)): a pre-norm linear sublayer returning (y, bias) like Megatron's."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = nn.RMSNorm(c, eps=1e-6)
        self.proj = nn.Linear(c, c)

    def forward(self, x):
        return self.proj(self.norm(x)), None


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_zero_gating_is_exactly_a_pre_norm_residual(variant):
    """With gating 0 and identical expanded streams, every stream is x + F(norm(x)), identical."""
    torch.manual_seed(0)
    c, n = 16, 4
    hc, f = _module(n=n, c=c, variant=variant, init_gating_factor=0.0), _PreNormSublayer(c)
    x = torch.randn(6, 2, c)
    agg, h_res, h_post, residual = hc(expand(x, n))
    out = hc.post_residual_bda(h_res, residual, h_post, f(agg)).view(6, 2, n, c)
    expected = x + f(x)[0]
    for i in range(n):
        torch.testing.assert_close(out[:, :, i], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, :, i], out[:, :, 0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_default_init_starts_close_to_a_pre_norm_residual(variant):
    """At the default gating (0.01) the streams stay identical to within 2 % of the signal."""
    torch.manual_seed(0)
    c, n = 64, 4
    hc, f = _module(n=n, c=c, variant=variant), _PreNormSublayer(c)
    x = torch.randn(8, 2, c)
    stream = expand(x, n)
    for _ in range(4):  # four sublayers in a row
        agg, h_res, h_post, residual = hc(stream)
        stream = hc.post_residual_bda(h_res, residual, h_post, f(agg))
    s = stream.view(8, 2, n, c)
    spread = (s - s.mean(dim=2, keepdim=True)).abs().max() / s.abs().max()
    assert spread < 0.02, f"stream spread {spread:.3e}"


@settings(max_examples=20, deadline=None)
@given(
    s=st.integers(0, 4),
    b=st.integers(1, 3),
    n=st.sampled_from([1, 2, 3, 4, 8]),
    c=st.sampled_from([1, 4, 8]),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_shapes_and_finiteness(s, b, n, c, variant, seed):
    """Any s, b, n, C: correct shapes, finite values, doubly stochastic h_res within 2e-6 on one axis."""
    torch.manual_seed(seed)  # the module's initialisation and x: replayable by hypothesis
    m = _module(n=n, c=c, variant=variant)
    x = torch.randn(s, b, n * c)
    agg, h_res, h_post, _ = m(x)
    out = m.post_residual_bda(h_res, x, h_post, (agg, None))
    assert agg.shape == (s, b, c) and h_res.shape == (s, b, n, n) and out.shape == (s, b, n * c)
    assert torch.isfinite(out).all()
    if s:
        assert (h_res.sum(-2) - 1).abs().max() <= 2e-6 or (h_res.sum(-1) - 1).abs().max() <= 2e-6


class TestBadInput:
    """Config and shape errors name the field or argument."""

    @pytest.mark.parametrize(
        "kw, match",
        [
            ({"num_residual_streams": 0}, "num_residual_streams=0: must be an integer >= 1"),
            ({"sinkhorn_iterations": 0}, "sinkhorn_iterations=0: must be an integer >= 1"),
            ({"init_gating_factor": -0.1}, "init_gating_factor=-0.1: must be a finite number >= 0"),
            ({"init_gating_factor": float("inf")}, "init_gating_factor=inf: must be a finite number >= 0"),
            ({"variant": "v9"}, "variant='v9'"),
            ({"hidden_size": 0}, "hidden_size=0"),
        ],
        ids=["n0", "iters0", "gating-neg", "gating-inf", "variant", "hidden0"],
    )
    def test_config(self, kw, match):
        """Bad config fields raise ValueError naming the field and value."""
        args = {"hidden_size": 8} | kw
        with pytest.raises(ValueError, match=match):
            HyperConnectionConfig(**args)

    def test_config_is_frozen_and_keyword_only(self):
        """The config cannot be mutated or built positionally."""
        cfg = HyperConnectionConfig(hidden_size=8)
        with pytest.raises(AttributeError):
            cfg.hidden_size = 4  # type: ignore[misc]  # frozen: the assignment is the test
        with pytest.raises(TypeError):
            HyperConnectionConfig(8)  # type: ignore[call-arg]  # positional: the refusal is the test

    def test_wrong_width(self):
        """Hidden states whose width is not n*C name both numbers."""
        with pytest.raises(ValueError, match=r"n\*C = 4\*16 = 64, got \[2, 1, 48\]"):
            _module()(torch.zeros(2, 1, 48))

    def test_wrong_rank(self):
        """Hidden states must be [s, b, n*C]."""
        with pytest.raises(ValueError, match=r"hidden_states must have shape \[s, b, n\*C\]"):
            _module()(torch.zeros(2, 64))

    def test_bda_y_shape(self):
        """post_residual_bda checks y against [s, b, C]."""
        m = _module()
        x = torch.zeros(2, 1, 64)
        _, h_res, h_post, _ = m(x)
        with pytest.raises(ValueError, match=r"y must have shape \[s, b, C\] = \[2, 1, 16\]"):
            m.post_residual_bda(h_res, x, h_post, (torch.zeros(2, 1, 8), None))


class TestNumericsOptions:
    """The option fields of `HyperConnectionConfig` reach the ops, and a configuration name sets them."""

    def test_configuration_name_fills_the_option_fields(self):
        """variant='megatron_dev+eps_inside_sqrt' is the variant plus its option; numerics names it back."""
        cfg = HyperConnectionConfig(hidden_size=8, variant="megatron_dev+eps_inside_sqrt")
        assert cfg.variant is Variant.MEGATRON_DEV and cfg.norm_eps_placement == "inside_sqrt"
        assert cfg.numerics.name == "megatron_dev+eps_inside_sqrt"

    def test_an_option_set_twice_is_refused(self):
        """A configuration name and an option field together is a ValueError naming the field."""
        with pytest.raises(ValueError, match="norm_eps_placement='inside_sqrt': is set twice"):
            HyperConnectionConfig(
                hidden_size=8, variant="megatron_dev+eps_inside_sqrt", norm_eps_placement="inside_sqrt"
            )

    def test_bad_option_value(self):
        """An unknown choice is a ValueError listing the valid ones."""
        with pytest.raises(ValueError, match="mapping_precision='fp16': valid: fp32, activation"):
            HyperConnectionConfig(hidden_size=8, mapping_precision="fp16")

    @pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
    def test_eps_inside_reaches_the_mapping(self, fused, monkeypatch):
        """The module's coefficients are the mapping's under the configured spec, not the plain variant's; fused,
        the spec goes through the kernel dispatch (run on the reference backend here: that the compiled backend
        honours it is `suites/unit/kernels`' parity, `megatron_dev+eps_inside_sqrt` among its cases)."""
        torch.manual_seed(0)
        monkeypatch.setenv("MHC_BACKEND", "reference")
        cfg = HyperConnectionConfig(
            hidden_size=8,
            num_residual_streams=2,
            variant="paper",
            sinkhorn_iterations=4,
            norm_eps_placement="inside_sqrt",
            use_fused=fused,
        )
        hc = HyperConnectionModule(cfg)
        x = 1e-3 * torch.randn(3, 1, 16)  # small RMS: the eps placement shows
        _, _, h_post, _ = hc(x)
        args = (
            x.reshape(3, 16),
            hc.mapping_proj.weight,
            hc.alpha_pre,
            hc.alpha_post,
            hc.alpha_res,
            hc.bias,
            2,
        )
        inside = mhc_mapping(*args, "paper+eps_inside_sqrt")[1]
        outside = mhc_mapping(*args, "paper")[1]
        torch.testing.assert_close(h_post.reshape(3, 2), inside)
        assert not torch.allclose(inside, outside, rtol=0, atol=1e-6)

    def test_fp32_mappings_keep_megatron_main_parameters_fp32(self):
        """megatron_main casts its parameters with the model; with mapping_precision='fp32' they stay fp32."""
        plain = HyperConnectionModule(
            HyperConnectionConfig(hidden_size=8, variant="megatron_main")
        ).bfloat16()
        kept = HyperConnectionModule(
            HyperConnectionConfig(hidden_size=8, variant="megatron_main", mapping_precision="fp32")
        ).bfloat16()
        assert plain.bias.dtype == torch.bfloat16 and kept.bias.dtype == torch.float32
