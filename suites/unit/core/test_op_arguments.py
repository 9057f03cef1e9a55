"""Bad non-shape arguments of the reference ops and the module: a ValueError naming the argument and the value."""

from __future__ import annotations

import pytest
import torch

from mhc_core import HyperConnectionConfig, HyperConnectionModule, expand, ops

T, N, C = 5, 4, 8


def _agg(**kw):
    args = {"x": torch.randn(T, N, C), "h_pre": torch.rand(T, N)} | kw
    return ops.h_aggregate(**args)


def _bda(**kw):
    args = {"h_res": torch.rand(T, N, N), "residual": torch.randn(T, N, C), "h_post": torch.rand(T, N),
            "y": torch.randn(T, C), "bias": torch.randn(C), "dropout_p": 0.0, "training": False} | kw
    return ops.h_post_bda(**args)


def _mapping(**kw):
    args = {"x": torch.randn(T, N * C), "weight": torch.randn(N * N + 2 * N, N * C) * 0.1,
            "alpha_pre": torch.ones(1), "alpha_post": torch.ones(1), "alpha_res": torch.ones(1),
            "bias": torch.zeros(N * N + 2 * N), "n": N} | kw
    return ops.mapping(**args)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: _agg(x=torch.ones(T, N, C, dtype=torch.long)), r"h_aggregate: x must be a floating tensor .* got dtype torch.int64"),
    (lambda: _agg(x=torch.randn(T, 0, C), h_pre=torch.rand(T, 0)), r"h_aggregate: n=0 must be an integer >= 1"),
    (lambda: _bda(residual=torch.ones(T, N, C, dtype=torch.int32)), r"h_post_bda: residual must be a floating tensor"),
    (lambda: _bda(dropout_p=None), r"h_post_bda: dropout_p=None must be a finite number"),
    (lambda: _bda(dropout_p="0.1", training=True), r"h_post_bda: dropout_p='0.1' must be a finite number"),
    (lambda: _bda(dropout_p=1.0), r"h_post_bda: dropout_p=1.0 must be in \[0, 1\)"),
    (lambda: _mapping(x=torch.ones(T, N * C, dtype=torch.long)), r"mapping: x must be a floating tensor"),
    (lambda: _mapping(norm_eps=-1.0), r"mapping: norm_eps=-1.0 must be in \[0, inf\)"),
    (lambda: _mapping(norm_eps=float("nan")), r"mapping: norm_eps=nan must be a finite number"),
    (lambda: ops.sinkhorn(torch.randn(2, 4, 4), eps=float("nan")), r"sinkhorn: eps=nan must be a finite number"),
    (lambda: ops.sinkhorn(torch.randn(2, 4, 4), eps="abc"), r"sinkhorn: eps='abc' must be a finite number"),
], ids=["agg-int", "agg-n0", "bda-int", "bda-dropout-none", "bda-dropout-str", "bda-dropout-1", "map-int",
        "map-eps-neg", "map-eps-nan", "sk-eps-nan", "sk-eps-str"])
def test_bad_argument_is_named(call, match):
    """Integer tensors, n = 0, and a non-numeric or out-of-range dropout_p / eps / norm_eps are refused by name."""
    with pytest.raises(ValueError, match=match):
        call()


def test_module_names_the_non_finite_input_not_the_logits():
    """NaN in hidden_states is reported against hidden_states (and its index), not the Sinkhorn logits it spread to."""
    hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=16, num_residual_streams=4))
    x = expand(torch.randn(5, 2, 16), 4)
    x[3, 1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"HyperConnectionModule.forward: hidden_states of shape \[5, 2, 64\] holds "
                                         r"1 non-finite value\(s\) .* first at index \(3, 1, 7\)"):
        hc(x)
    with torch.no_grad():
        hc.bias[8] = float("inf")  # the first H_res logit ([pre(n) | post(n) | res(n*n)])
    with pytest.raises(ValueError, match=r"parameter bias of shape \[24\] holds 1 non-finite.*first at index \(8,\)"):
        hc(expand(torch.randn(5, 2, 16), 4))


def test_post_residual_bda_wants_the_pair():
    """Passing y alone instead of (y, bias) names output_with_bias and what it got."""
    hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=16, num_residual_streams=4))
    x = expand(torch.randn(5, 2, 16), 4)
    agg, h_res, h_post, res = hc(x)
    with pytest.raises(ValueError, match=r"output_with_bias must be the pair \(y \[s, b, C\], bias \[C\] or None\) "
                                         r"a Megatron sublayer returns, got a tensor \[5, 2, 16\]"):
        hc.post_residual_bda(h_res, res, h_post, agg)
