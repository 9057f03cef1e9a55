"""h_aggregate, h_post_bda (orientation per variant, dropout) and the block boundary ops."""

from __future__ import annotations

import pytest
import torch

from mhc_core import Variant, contract, expand, h_aggregate, h_post_bda, learned_contract

VARIANTS = list(Variant)


class TestOrientation:
    """An arbitrary (non-stochastic) 2x2 H pins the residual-mix orientation of each variant."""

    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]], dtype=torch.float64)
    res = torch.tensor([[[10.0, 100.0], [1.0, 2.0]]], dtype=torch.float64)  # [T=1, n=2, C=2]
    zero_post = torch.zeros(1, 2, dtype=torch.float64)
    zero_y = torch.zeros(1, 2, dtype=torch.float64)

    @pytest.mark.parametrize("variant", ["paper", "megatron_main"])
    def test_h_at_x(self, variant):
        """paper and megatron_main mix with H @ x: [[12, 104], [34, 308]]."""
        out = h_post_bda(self.h, self.res, self.zero_post, self.zero_y, None, variant=variant)
        assert torch.equal(out[0], torch.tensor([[12.0, 104.0], [34.0, 308.0]], dtype=torch.float64))

    def test_megatron_dev_h_transpose_at_x(self):
        """megatron_dev mixes with H^T @ x: [[13, 106], [24, 208]] (upstream's exact test)."""
        out = h_post_bda(self.h, self.res, self.zero_post, self.zero_y, None, variant="megatron_dev")
        assert torch.equal(out[0], torch.tensor([[13.0, 106.0], [24.0, 208.0]], dtype=torch.float64))

    @pytest.mark.parametrize("variant", VARIANTS, ids=str)
    def test_branch_is_h_post_times_y_plus_bias(self, variant):
        """The branch adds h_post_i * (y + bias) to every stream."""
        h_post = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
        y = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
        bias = torch.tensor([0.25, 0.5], dtype=torch.float64)
        zero_h = torch.zeros(1, 2, 2, dtype=torch.float64)
        out = h_post_bda(zero_h, self.res, h_post, y, bias, variant=variant)
        assert torch.equal(out[0], torch.tensor([[0.625, -0.25], [2.5, -1.0]], dtype=torch.float64))


class TestDropout:
    """Dropout acts on the expanded branch only, as Megatron's bias-dropout-add."""

    def _args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None]:
        torch.manual_seed(0)
        t, n, c = 64, 4, 32
        return (
            torch.eye(n).expand(t, n, n).clone(),
            torch.randn(t, n, c),
            torch.ones(t, n),
            torch.ones(t, c),
            None,
        )

    def test_eval_ignores_dropout(self):
        """training=False: no element is dropped."""
        h, res, post, y, b = self._args()
        out = h_post_bda(h, res, post, y, b, dropout_p=0.5, training=False)
        torch.testing.assert_close(out, res + 1.0)

    def test_training_drops_and_rescales_branch_per_stream(self):
        """training=True: branch elements are 0 or 1/(1-p), independently per stream; residual intact."""
        h, res, post, y, b = self._args()
        torch.manual_seed(1)
        branch = h_post_bda(h, res, post, y, b, dropout_p=0.5, training=True) - res
        values = set(torch.round(branch, decimals=4).unique().tolist())
        assert values == {0.0, 2.0}
        assert not torch.equal(branch[:, 0], branch[:, 1])

    @pytest.mark.parametrize("p", [-0.1, 1.0], ids=str)
    def test_bad_p(self, p):
        """dropout_p outside [0, 1) is rejected."""
        with pytest.raises(ValueError, match=f"dropout_p={p!r}"):
            h_post_bda(*self._args(), dropout_p=p, training=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_gradcheck_h_post_bda(variant):
    """All five inputs' gradients equal finite differences (fp64, no dropout)."""
    torch.manual_seed(0)
    t, n, c = 3, 3, 2
    args = [
        torch.rand(t, n, n, dtype=torch.float64),
        torch.randn(t, n, c, dtype=torch.float64),
        torch.rand(t, n, dtype=torch.float64),
        torch.randn(t, c, dtype=torch.float64),
        torch.randn(c, dtype=torch.float64),
    ]
    inputs = tuple(a.requires_grad_(True) for a in args)
    assert torch.autograd.gradcheck(
        lambda h_res, residual, h_post, y, bias: h_post_bda(
            h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=variant
        ),
        inputs,
    )


def test_gradcheck_h_aggregate():
    """x and h_pre gradients equal finite differences (fp64)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    h = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(h_aggregate, (x, h))


def test_h_aggregate_value():
    """out = sum_i h_pre_i x_i."""
    x = torch.tensor([[[1.0, 2.0], [10.0, 20.0]]])
    h = torch.tensor([[0.5, 0.25]])
    assert torch.equal(h_aggregate(x, h), torch.tensor([[3.0, 6.0]]))


def test_h_aggregate_bf16_rounds_once():
    """bf16 inputs accumulate in fp32 and round once."""
    torch.manual_seed(0)
    x = torch.randn(16, 4, 64).to(torch.bfloat16)
    h = torch.rand(16, 4).to(torch.bfloat16)
    exact = torch.einsum("tn,tnc->tc", h.double(), x.double())
    out = h_aggregate(x, h)
    assert out.dtype == torch.bfloat16
    # Rounded once: within half a bf16 ulp of the exact sum everywhere (a bf16 accumulation is off
    # by up to 79 half-ulps here), and bitwise the fp32 computation rounded.
    half_ulp = torch.exp2(torch.floor(torch.log2(exact.abs())) - 8)
    worst = float(((out.double() - exact).abs() / half_ulp).max())
    assert worst <= 1.0 + 1e-6, f"max error {worst:.3g} half-ulps of bf16"
    assert torch.equal(out, h_aggregate(x.float(), h.float()).to(torch.bfloat16))


class TestStreams:
    """expand copies, contract averages, learned_contract weights the streams."""

    def test_expand_copies(self):
        """Every stream of expand(x) equals x and owns its memory."""
        x = torch.randn(3, 2, 5)
        y = expand(x, 4)
        assert y.shape == (3, 2, 20)
        for i in range(4):
            assert torch.equal(y.view(3, 2, 4, 5)[:, :, i], x)
        assert y.data_ptr() != x.data_ptr() and y.is_contiguous()

    def test_contract_is_mean(self):
        """contract = view(s, b, n, C).mean(2); contract(expand(x)) == x."""
        x = torch.randn(3, 2, 12)
        torch.testing.assert_close(contract(x, 3), x.view(3, 2, 3, 4).mean(2))
        z = torch.randn(3, 2, 4)
        torch.testing.assert_close(contract(expand(z, 3), 3), z)

    def test_learned_contract_by_hand(self):
        """Zero head_fn: pre = sigmoid(base) + eps, y = sum_i pre_i x_i."""
        x = torch.randn(2, 1, 6, dtype=torch.float64)
        base = torch.tensor([0.0, 1.0], dtype=torch.float64)
        y = learned_contract(
            x, torch.zeros(2, 6, dtype=torch.float64), base, torch.ones(1, dtype=torch.float64), 2, 1e-5
        )
        pre = torch.sigmoid(base) + 1e-5
        torch.testing.assert_close(y, pre[0] * x[..., :3] + pre[1] * x[..., 3:])

    def test_gradcheck_learned_contract(self):
        """Gradients of x, head_fn, head_base, head_scale equal finite differences."""
        torch.manual_seed(0)
        args = (
            torch.randn(2, 2, 6, dtype=torch.float64),
            torch.randn(2, 6, dtype=torch.float64) * 0.3,
            torch.randn(2, dtype=torch.float64),
            torch.ones(1, dtype=torch.float64),
        )
        inputs = tuple(a.requires_grad_(True) for a in args)
        assert torch.autograd.gradcheck(
            lambda x, head_fn, head_base, head_scale: learned_contract(
                x, head_fn, head_base, head_scale, n=2, eps=1e-5
            ),
            inputs,
        )

    @pytest.mark.parametrize("fn", [expand, contract], ids=lambda f: f.__name__)
    def test_gradcheck_expand_contract(self, fn):
        """expand and contract are differentiable."""
        x = torch.randn(2, 2, 6, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: fn(t, 3), (x,))

    def test_contract_rejects_indivisible_width(self):
        """A width that is not a multiple of n names both."""
        with pytest.raises(
            ValueError, match=r"hidden width 10 of x \[2, 1, 10\] is not a positive multiple of n=4"
        ):
            contract(torch.zeros(2, 1, 10), 4)

    def test_empty_sequence(self):
        """s = 0 works through expand and contract."""
        assert expand(torch.zeros(0, 2, 5), 4).shape == (0, 2, 20)
        assert contract(torch.zeros(0, 2, 20), 4).shape == (0, 2, 5)


class TestApplyBadInput:
    """Shape mismatches name the argument."""

    def test_h_pre_mismatch(self):
        """h_pre must be [T, n] for x [T, n, C]."""
        with pytest.raises(ValueError, match=r"h_pre must have shape \[T, n\] = \[2, 4\], got \[2, 3\]"):
            h_aggregate(torch.zeros(2, 4, 8), torch.zeros(2, 3))

    def test_h_res_mismatch(self):
        """h_res must be [T, n, n]."""
        with pytest.raises(ValueError, match=r"h_res must have shape \[T, n, n\]"):
            h_post_bda(torch.zeros(2, 3, 3), torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 8), None)

    def test_bias_mismatch(self):
        """bias must be [C]."""
        with pytest.raises(ValueError, match=r"bias must have shape \[C\] = \[8\], got \[4\]"):
            h_post_bda(
                torch.zeros(2, 4, 4),
                torch.zeros(2, 4, 8),
                torch.zeros(2, 4),
                torch.zeros(2, 8),
                torch.zeros(4),
            )
