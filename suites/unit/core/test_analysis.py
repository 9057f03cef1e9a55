"""Composite Amax gain and the bytes-moved model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mhc_core import Variant, amax_gain, bytes_moved, sinkhorn
from mhc_core.analysis import OPS, layer_extra_bytes


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_mhc_stays_bounded_where_hc_explodes(variant):
    """60 random sublayers: mHC composite forward gain < 2; plain HC (exp of the logits) > 10."""
    torch.manual_seed(0)
    logits = torch.randn(60, 32, 4, 4)  # [L, T, n, n]
    mhc = amax_gain(sinkhorn(logits, 20, variant=variant), transposed=variant is Variant.MEGATRON_DEV)
    hc = amax_gain(torch.exp(logits))
    assert mhc.forward < 2.0 and mhc.backward < 2.0, mhc
    assert hc.forward > 10.0 and hc.backward > 10.0, hc


def test_gain_by_hand():
    """Forward gain is the max |row sum|, backward the max |column sum|, of the product."""
    a = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    b = torch.tensor([[2.0, 0.0], [1.0, -1.0]])
    gain = amax_gain(torch.stack([a, b]))  # composite = b @ a = [[2, 4], [1, 1]]
    assert (gain.forward, gain.backward) == (6.0, 5.0)
    gain_t = amax_gain(torch.stack([a, b]), transposed=True)  # b^T @ a^T = (a @ b)^T = [[4, 1], [-2, -1]]
    assert (gain_t.forward, gain_t.backward) == (5.0, 6.0)


def test_gain_takes_the_worst_token():
    """The maximum is over tokens."""
    eye = torch.eye(2).expand(3, 2, 2).clone()
    eye[1] *= 5
    assert amax_gain(eye.unsqueeze(0)).forward == 5.0


def test_bytes_model_matches_the_anchor_table():
    """T=8192, C=4096, n=4, bf16: h_aggregate fwd ~335.7 MB, h_post_bda fwd ~604.6 MB."""
    kw: dict[str, Any] = dict(tokens=8192, n=4, hidden=4096, act_bytes=2)
    assert bytes_moved("h_aggregate", "fwd", **kw).total / 1e6 == pytest.approx(335.7, rel=2e-3)
    assert bytes_moved("h_post_bda", "fwd", **kw).total / 1e6 == pytest.approx(604.6, rel=2e-3)
    assert bytes_moved("residual_add", "fwd", **kw).total / 1e6 == pytest.approx(201.3, rel=2e-3)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_the_fused_pre_op_moves_x_once(direction):
    """The pre-op's model reads the streams once where mapping, Sinkhorn and aggregate read them twice forward
    (and write two gradients of x backward): at T 8192, C 4096, n 4, bf16 it saves one x-sized pass or more."""
    kw: dict[str, Any] = dict(tokens=8192, n=4, hidden=4096, act_bytes=2)
    x_bytes = 8192 * 4 * 4096 * 2
    fused = bytes_moved("pre", direction, **kw).total
    parts = sum(bytes_moved(op, direction, **kw).total for op in ("mapping", "sinkhorn", "h_aggregate"))
    assert parts - fused >= x_bytes, (parts, fused)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_bytes_model_positive(op, direction):
    """Every op and direction moves a positive number of bytes."""
    b = bytes_moved(op, direction, tokens=16, n=4, hidden=32, act_bytes=4)
    assert b.read > 0 and b.written > 0


def test_bytes_model_unknown_op():
    """An unknown op lists the known ones."""
    with pytest.raises(ValueError, match="op='conv'.*sinkhorn"):
        bytes_moved("conv", "fwd", tokens=1, n=1, hidden=1, act_bytes=2)


def test_amax_gain_rejects_non_square():
    """A stack that is not [L, T, n, n] names its shape."""
    with pytest.raises(ValueError, match=r"\[L>=1, T, n, n\], got \[2, 3, 4, 5\]"):
        amax_gain(torch.zeros(2, 3, 4, 5))


def test_layer_extra_bytes_by_hand():
    """T=1, n=2, C=1, bf16: per sublayer 574 B of mHC ops (fwd+bwd) minus 12 B of residual add, x2 sublayers."""
    assert layer_extra_bytes(tokens=1, n=2, hidden=1, act_bytes=2) == 1124
    assert layer_extra_bytes(tokens=1, n=2, hidden=1, act_bytes=2, sublayers=1) == 562
