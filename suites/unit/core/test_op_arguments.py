"""Bad non-shape arguments of the reference ops and the module: a ValueError naming the argument and the value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhc_core import HyperConnectionConfig, HyperConnectionModule, expand, ops

T, N, C = 5, 4, 8


def _agg(**kw):
    args = {"x": torch.randn(T, N, C), "h_pre": torch.rand(T, N)} | kw
    return ops.h_aggregate(**args)


def _bda(**kw):
    args = {
        "h_res": torch.rand(T, N, N),
        "residual": torch.randn(T, N, C),
        "h_post": torch.rand(T, N),
        "y": torch.randn(T, C),
        "bias": torch.randn(C),
        "dropout_p": 0.0,
        "training": False,
    } | kw
    return ops.h_post_bda(**args)


def _mapping(**kw):
    args = {
        "x": torch.randn(T, N * C),
        "weight": torch.randn(N * N + 2 * N, N * C) * 0.1,
        "alpha_pre": torch.ones(1),
        "alpha_post": torch.ones(1),
        "alpha_res": torch.ones(1),
        "bias": torch.zeros(N * N + 2 * N),
        "n": N,
    } | kw
    return ops.mapping(**args)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: _agg(x=torch.ones(T, N, C, dtype=torch.long)),
            r"h_aggregate: x must be a floating tensor .* got dtype torch.int64",
        ),
        (
            lambda: _agg(x=torch.randn(T, 0, C), h_pre=torch.rand(T, 0)),
            r"h_aggregate: n=0 must be an integer >= 1",
        ),
        (
            lambda: _bda(residual=torch.ones(T, N, C, dtype=torch.int32)),
            r"h_post_bda: residual must be a floating tensor",
        ),
        (lambda: _bda(dropout_p=None), r"h_post_bda: dropout_p=None must be a finite number"),
        (
            lambda: _bda(dropout_p="0.1", training=True),
            r"h_post_bda: dropout_p='0.1' must be a finite number",
        ),
        (lambda: _bda(dropout_p=1.0), r"h_post_bda: dropout_p=1.0 must be in \[0, 1\)"),
        (lambda: _mapping(x=torch.ones(T, N * C, dtype=torch.long)), r"mapping: x must be a floating tensor"),
        (lambda: _mapping(norm_eps=-1.0), r"mapping: norm_eps=-1.0 must be in \[0, inf\)"),
        (lambda: _mapping(norm_eps=float("nan")), r"mapping: norm_eps=nan must be a finite number"),
        (
            lambda: ops.sinkhorn(torch.randn(2, 4, 4), eps=float("nan")),
            r"sinkhorn: eps=nan must be a finite number",
        ),
        (
            lambda: ops.sinkhorn(torch.randn(2, 4, 4), eps="abc"),
            r"sinkhorn: eps='abc' must be a finite number",
        ),
    ],
    ids=[
        "agg-int",
        "agg-n0",
        "bda-int",
        "bda-dropout-none",
        "bda-dropout-str",
        "bda-dropout-1",
        "map-int",
        "map-eps-neg",
        "map-eps-nan",
        "sk-eps-nan",
        "sk-eps-str",
    ],
)
def test_bad_argument_is_named(call, match):
    """Integer tensors, n = 0, and a non-numeric or out-of-range dropout_p / eps / norm_eps are refused by name."""
    with pytest.raises(ValueError, match=match):
        call()


def test_module_names_the_non_finite_input_not_the_logits():
    """NaN in hidden_states is reported against hidden_states (and its index), not the Sinkhorn logits it spread to."""
    hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=16, num_residual_streams=4))
    x = expand(torch.randn(5, 2, 16), 4)
    x[3, 1, 7] = float("nan")
    with pytest.raises(
        ValueError,
        match=r"HyperConnectionModule.forward: hidden_states of shape \[5, 2, 64\] holds "
        r"1 non-finite value\(s\) .* first at index \(3, 1, 7\)",
    ):
        hc(x)
    with torch.no_grad():
        hc.bias[8] = float("inf")  # the first H_res logit ([pre(n) | post(n) | res(n*n)])
    with pytest.raises(
        ValueError, match=r"parameter bias of shape \[24\] holds 1 non-finite.*first at index \(8,\)"
    ):
        hc(expand(torch.randn(5, 2, 16), 4))


def test_post_residual_bda_wants_the_pair():
    """Passing y alone instead of (y, bias) names output_with_bias and what it got."""
    hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=16, num_residual_streams=4))
    x = expand(torch.randn(5, 2, 16), 4)
    agg, h_res, h_post, res = hc(x)
    with pytest.raises(
        ValueError,
        match=r"output_with_bias must be the pair \(y \[s, b, C\], bias \[C\] or None\) "
        r"a Megatron sublayer returns, got a tensor \[5, 2, 16\]",
    ):
        hc.post_residual_bda(h_res, res, h_post, agg)


@pytest.mark.parametrize("as_int", [np.int64, np.int32, np.uint8], ids=["int64", "int32", "uint8"])
def test_numpy_integers_count_as_integers(as_int):
    """NumPy integers for n / iterations / config counts give the same result as Python ints (as a config read
    with NumPy would pass them); the config stores a Python int."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, N * C)
    assert torch.equal(expand(x[..., :C], as_int(N)), expand(x[..., :C], N))
    assert torch.equal(ops.contract(x, as_int(N)), ops.contract(x, N))
    torch.manual_seed(1)
    got = _mapping(n=as_int(N))
    torch.manual_seed(1)
    assert all(torch.equal(a, b) for a, b in zip(got, _mapping(), strict=True))
    logits = torch.randn(2, N, N)
    assert torch.equal(ops.sinkhorn(logits, as_int(5)), ops.sinkhorn(logits, 5))
    cfg = HyperConnectionConfig(
        hidden_size=as_int(C), num_residual_streams=as_int(N), sinkhorn_iterations=as_int(3)
    )
    assert (type(cfg.hidden_size), type(cfg.num_residual_streams), type(cfg.sinkhorn_iterations)) == (
        int,
        int,
        int,
    )
    assert cfg == HyperConnectionConfig(hidden_size=C, num_residual_streams=N, sinkhorn_iterations=3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: expand(torch.randn(3, 2, C), True), r"expand: n=True must be an integer >= 1"),
        (
            lambda: expand(torch.randn(3, 2, C), np.float64(4.0)),
            r"expand: n=(np\.float64\()?4\.0\)? must be an integer",
        ),
        (
            lambda: ops.sinkhorn(torch.randn(2, N, N), np.bool_(True)),
            r"sinkhorn: iterations=(np\.)?True_? must be an integer",
        ),
        (
            lambda: ops.sinkhorn(torch.randn(2, N, N), np.int64(0)),
            r"sinkhorn: iterations=(np\.int64\()?0\)? must be an integer >= 1",
        ),
        (lambda: _mapping(n=4.0), r"mapping: n=4.0 must be an integer >= 1"),
    ],
    ids=["bool", "np-float", "np-bool", "np-zero", "float"],
)
def test_non_integers_are_still_refused(call, match):
    """Bools (Python or NumPy), floats and NumPy zero are refused as counts, by name."""
    with pytest.raises(ValueError, match=match):
        call()
