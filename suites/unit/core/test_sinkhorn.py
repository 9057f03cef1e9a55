"""Sinkhorn-Knopp: per-variant conventions, sums, gradients, memory, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mhc_core import Variant, get_variant, sinkhorn

VARIANTS = list(Variant)

# Bounds on the sums that are NOT normalised last, after 20 iterations, n = 4, logits
# scale * N(0, 1) in fp32 (documented in docs/variants.md). Keyed by the largest scale they cover.
OTHER_SUM_BOUND = {
    Variant.PAPER: {1e-1: 1e-4, 1.0: 2e-3, 10.0: 0.5, 1e3: 3.0},
    Variant.MEGATRON_MAIN: {1e-1: 1e-4, 1.0: 2e-3, 10.0: 0.5, 1e3: 3.0},
    Variant.MEGATRON_DEV: {1e-1: 1e-4, 1.0: 2e-3, 10.0: 0.2, 1e3: 0.2},
}
SCALES = [1e-3, 1e-1, 1.0, 10.0, 1e2, 1e3]


def _other_bound(variant: Variant, scale: float) -> float:
    return next(b for s, b in sorted(OTHER_SUM_BOUND[variant].items()) if scale <= s)


class TestHandComputed:
    """One exact case per variant pins its Sinkhorn convention."""

    # exp(Z) = [[1, 3], [1, 1]]
    Z = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)

    def test_paper_normalises_columns_then_rows(self):
        """paper, 1 iteration: column sums [2, 4], then rows -> [[0.4, 0.6], [2/3, 1/3]]."""
        out = sinkhorn(self.Z, 1, variant="paper")
        expected = torch.tensor([[0.4, 0.6], [2 / 3, 1 / 3]], dtype=torch.float64)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)

    def test_megatron_main_normalises_rows_then_columns(self):
        """megatron_main, 1 iteration: rows [[.25, .75], [.5, .5]], then columns -> [[1/3, .6], [2/3, .4]]."""
        out = sinkhorn(self.Z, 1, variant="megatron_main")
        expected = torch.tensor([[1 / 3, 0.6], [2 / 3, 0.4]], dtype=torch.float64)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)

    def test_megatron_dev_adds_eps_to_softmax_and_sums(self):
        """megatron_dev, 1 iteration: (softmax + e) / (colsum + e) with e = 1e-6, by hand."""
        e = 1e-6
        m = [[0.25 + e, 0.75 + e], [0.5 + e, 0.5 + e]]
        cols = [m[0][0] + m[1][0], m[0][1] + m[1][1]]
        expected = torch.tensor(
            [[m[i][j] / (cols[j] + e) for j in range(2)] for i in range(2)], dtype=torch.float64
        )
        out = sinkhorn(self.Z, 1, variant="megatron_dev")
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
        assert (out - sinkhorn(self.Z, 1, variant="megatron_main")).abs().max() > 1e-7

    def test_megatron_main_clamps_tiny_sums(self):
        """megatron_main divides by clamp(sum, 1e-6): a column that underflows stays zero."""
        z = torch.tensor([[0.0, -200.0], [0.0, -200.0]], dtype=torch.float32)
        out = sinkhorn(z, 3, variant="megatron_main")
        assert torch.equal(out[:, 1], torch.zeros(2))
        torch.testing.assert_close(out[:, 0], torch.full((2,), 0.5))


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale{s:g}")
def test_sums_after_20_iterations(variant, scale):
    """The sums normalised last are 1 to 1e-6; the others stay within the documented bound."""
    torch.manual_seed(0)
    z = torch.randn(512, 4, 4) * scale
    out = sinkhorn(z, 20, variant=variant)
    spec = get_variant(variant)
    rows, cols = out.sum(-1), out.sum(-2)
    assert (out >= 0).all()
    if spec.exact_sums == "rows":
        exact, other = rows, cols
    elif spec.exact_sums == "cols":
        exact, other = cols, rows
    else:  # megatron_dev: columns are S / (S + eps), one eps-step short of 1.
        exact, other = cols, rows
    if variant is Variant.MEGATRON_MAIN and scale >= 1e2:
        # Beyond the fp32 exp range whole columns underflow; upstream's clamp leaves them at 0.
        nonempty = exact > 0
        assert (exact[nonempty] - 1).abs().max() <= 1e-6
        assert (exact[~nonempty] == 0).all()
    elif variant is Variant.MEGATRON_DEV:
        assert ((1 - exact) >= -1e-6).all() and ((1 - exact) <= 2e-6).all(), f"{(1 - exact).abs().max():.3e}"
    else:
        assert (exact - 1).abs().max() <= 1e-6, f"max |sum - 1| = {(exact - 1).abs().max():.3e}"
    worst = float((other - 1).abs().max())
    assert worst <= _other_bound(variant, scale), f"other sums off by {worst:.3e} at scale {scale}"


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_bf16_input_returns_bf16_with_exact_sums(variant):
    """bf16 logits are iterated in fp32 and rounded once: exact sums hold to bf16 rounding."""
    torch.manual_seed(1)
    z = torch.randn(64, 4, 4).to(torch.bfloat16)
    out = sinkhorn(z, 20, variant=variant)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, sinkhorn(z.float(), 20, variant=variant).to(torch.bfloat16))  # fp32, rounded once
    axis = {"rows": -1, "cols": -2, "none": -2}[get_variant(variant).exact_sums]
    assert (out.float().sum(axis) - 1).abs().max() <= 4 * 2**-8


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_gradcheck_fp64(variant):
    """The recompute backward equals finite differences (fp64)."""
    torch.manual_seed(2)
    z = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 5, variant=variant), (z,))


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_saved_bytes_do_not_grow_with_iterations(variant):
    """Bytes saved for backward are the same at 5 and 50 iterations."""

    def saved_bytes(iterations: int) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        z = torch.randn(256, 4, 4, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sinkhorn(z, iterations, variant=variant)
        return total

    five, fifty = saved_bytes(5), saved_bytes(50)
    assert five == fifty
    assert five > 0


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_backward_matches_plain_autograd(variant):
    """The recompute backward equals autograd through the unrolled iteration."""
    from mhc_core.ops.sinkhorn import sinkhorn_iterate

    torch.manual_seed(3)
    z = torch.randn(8, 3, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(8, 3, 3, dtype=torch.float64)
    (a,) = torch.autograd.grad(sinkhorn(z, 7, variant=variant), z, g)
    spec = get_variant(variant)
    (b,) = torch.autograd.grad(sinkhorn_iterate(z, 7, spec.sinkhorn_eps, spec), z, g)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(0, 9),
    n=st.sampled_from([1, 2, 3, 4, 8]),
    variant=st.sampled_from(VARIANTS),
    scale=st.sampled_from([1e-2, 1.0, 5.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_shape_range_and_exact_sums(t, n, variant, scale, seed):
    """Any T and n: output shape [T, n, n], entries in [0, 1], exact sums within 1e-6 (2e-6 dev)."""
    z = (
        torch.randn(t, n, n, generator=torch.Generator().manual_seed(seed)) * scale
    )  # replayable by hypothesis
    out = sinkhorn(z, 20, variant=variant)
    assert out.shape == (t, n, n)
    assert ((out >= 0) & (out <= 1 + 1e-6)).all()
    axis = {"rows": -1, "cols": -2, "none": -2}[get_variant(variant).exact_sums]
    tol = 2e-6 if variant is Variant.MEGATRON_DEV else 1e-6
    if t:
        assert (out.sum(axis) - 1).abs().max() <= tol


class TestBadInput:
    """Bad arguments raise ValueError naming the argument."""

    def test_not_square(self):
        """A non-square last pair of dims names the shape."""
        with pytest.raises(ValueError, match=r"logits must have shape \[..., n, n\].*\[2, 3, 4\]"):
            sinkhorn(torch.zeros(2, 3, 4), 3)

    def test_rank_one(self):
        """A 1-D tensor is rejected."""
        with pytest.raises(ValueError, match="logits"):
            sinkhorn(torch.zeros(4), 3)

    @pytest.mark.parametrize("iterations", [0, -1, 2.5, True], ids=repr)
    def test_iterations(self, iterations):
        """iterations must be an int >= 1."""
        with pytest.raises(ValueError, match=f"iterations={iterations!r}"):
            sinkhorn(torch.zeros(1, 2, 2), iterations)

    def test_unknown_variant(self):
        """An unknown variant lists the valid ones."""
        with pytest.raises(ValueError, match="variant='v3'.*paper, megatron_main, megatron_dev"):
            sinkhorn(torch.zeros(1, 2, 2), 3, variant="v3")

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
    def test_non_finite_logits(self, bad):
        """NaN or inf logits raise instead of returning a NaN matrix."""
        z = torch.zeros(3, 2, 2)
        z[1, 0, 1] = bad
        with pytest.raises(ValueError, match=r"logits of shape \[3, 2, 2\] holds 1 non-finite.*\(1, 0, 1\)"):
            sinkhorn(z, 3)

    def test_empty_tokens(self):
        """T = 0 returns an empty [0, n, n] result, also through backward."""
        z = torch.zeros(0, 4, 4, requires_grad=True)
        out = sinkhorn(z, 20)
        assert out.shape == (0, 4, 4)
        out.sum().backward()
        assert z.grad.shape == (0, 4, 4)
