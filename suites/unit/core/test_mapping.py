"""The coefficient mapping: hand-computed values, precision per variant, gradients, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from mhc_core import Variant, mapping

VARIANTS = list(Variant)


def _params(
    n: int, c: int, dtype=torch.float64, seed: int = 0
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big_n = n * n + 2 * n
    w = torch.randn(big_n, n * c, generator=g, dtype=dtype) * 0.3
    a_pre, a_post, a_res = (torch.rand(1, generator=g, dtype=dtype) + 0.1 for _ in range(3))
    bias = torch.randn(big_n, generator=g, dtype=dtype) * 0.1
    return w, (a_pre, a_post, a_res), bias


class TestHandComputed:
    """n = 1, C = 2, x = [3, 4]: every coefficient by hand (RMS after the projection, eps outside)."""

    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    a_pre, a_post, a_res = (torch.tensor([v], dtype=torch.float64) for v in (0.5, 0.25, 1.0))
    bias = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)

    def _expected(self, h_pre_eps: float):
        r = 1.0 / (5.0 / math.sqrt(2.0) + 1e-6)
        sig = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731
        return (
            sig(r * 3.0 * 0.5 + 0.1) + h_pre_eps,
            2.0 * sig(r * 4.0 * 0.25 + 0.2),
            r * 7.0 * 1.0 + 0.3,
        )

    @pytest.mark.parametrize("variant", VARIANTS, ids=str)
    def test_values(self, variant):
        """h_pre = sigmoid(.) (+1e-6 for megatron_dev), h_post = 2 sigmoid(.), logits raw."""
        h_pre, h_post, logits = mapping(
            self.x, self.w, self.a_pre, self.a_post, self.a_res, self.bias, 1, variant
        )
        want = self._expected(1e-6 if variant is Variant.MEGATRON_DEV else 0.0)
        got = (h_pre.item(), h_post.item(), logits.item())
        for name, g, w in zip(("h_pre", "h_post", "h_res_logits"), got, want, strict=True):
            assert g == pytest.approx(w, rel=0, abs=1e-14), name
        assert h_pre.shape == (1, 1) and h_post.shape == (1, 1) and logits.shape == (1, 1, 1)

    @pytest.mark.parametrize("variant", VARIANTS, ids=str)
    def test_values_eps_inside_sqrt(self, variant):
        """With `eps_inside_sqrt`, r = rsqrt(mean(x^2) + eps) = 1 / sqrt(12.5 + 1e-6)."""
        spec = f"{variant}+eps_inside_sqrt"
        h_pre, h_post, logits = mapping(
            self.x, self.w, self.a_pre, self.a_post, self.a_res, self.bias, 1, spec
        )
        r = 1.0 / math.sqrt(12.5 + 1e-6)
        sig = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731
        want = (
            sig(r * 1.5 + 0.1) + (1e-6 if variant is Variant.MEGATRON_DEV else 0.0),
            2.0 * sig(r + 0.2),
            r * 7.0 + 0.3,
        )
        for name, g, w in zip(
            ("h_pre", "h_post", "h_res_logits"),
            (h_pre.item(), h_post.item(), logits.item()),
            want,
            strict=True,
        ):
            assert g == pytest.approx(w, rel=0, abs=1e-14), name

    def test_eps_placement_matters_only_at_small_rms(self):
        """At RMS ~1 the two placements agree to ~eps; at RMS 1e-3 they differ by far more than rounding."""

        def logits(x, spec):
            return mapping(x, self.w, self.a_pre, self.a_post, self.a_res, self.bias, 1, spec)[2]

        near = (logits(self.x, "paper") - logits(self.x, "paper+eps_inside_sqrt")).abs().item()
        small = self.x * 1e-3
        far = (logits(small, "paper") - logits(small, "paper+eps_inside_sqrt")).abs().item()
        assert near < 1e-6 and far > 1e-4, (near, far)

    @pytest.mark.parametrize(
        ("spec", "dtype", "compute"),
        [
            ("megatron_main+dtype_eps_inside_sqrt", torch.float32, torch.float32),
            ("megatron_main+dtype_eps_inside_sqrt", torch.bfloat16, torch.bfloat16),
            ("megatron_dev+dtype_eps_inside_sqrt", torch.bfloat16, torch.float32),
            ("paper+dtype_eps_inside_sqrt", torch.float64, torch.float64),
        ],
        ids=str,
    )
    def test_dtype_eps_is_the_compute_dtypes_machine_eps(self, spec, dtype, compute):
        """`dtype_eps_inside_sqrt` adds `finfo(compute dtype).eps` inside the square root, whatever eps is
        passed: bitwise the `eps_inside_sqrt` mapping given that eps (fp32: 1.19e-7)."""
        g = torch.Generator().manual_seed(3)
        n, c, t = 2, 4, 5
        x = (torch.randn(t, n * c, generator=g) * 1e-3).to(dtype)
        w = torch.randn(n * n + 2 * n, n * c, generator=g).to(dtype)
        a_pre, a_post, a_res = (torch.rand(1, generator=g).to(dtype) for _ in range(3))
        bias = torch.randn(n * n + 2 * n, generator=g).to(dtype)

        def run(s, eps):
            return mapping(x, w, a_pre, a_post, a_res, bias, n, s, norm_eps=eps)

        inside = spec.replace("dtype_eps_inside_sqrt", "eps_inside_sqrt")
        got, want = run(spec, 0.25), run(inside, torch.finfo(compute).eps)
        for name, a, b in zip(("h_pre", "h_post", "h_res_logits"), got, want, strict=True):
            assert torch.equal(a, b), name
        assert not torch.equal(got[2], run(inside, 1e-6)[2]), (
            "at RMS 1e-3 the dtype eps must differ from 1e-6"
        )

    def test_bias_layout_is_pre_post_res_row_major(self):
        """bias [pre(n) | post(n) | res(n*n row-major)]: with zero weight the logits are the bias."""
        n, c = 3, 2
        big_n = n * n + 2 * n
        bias = torch.arange(big_n, dtype=torch.float64)
        zero = torch.zeros(1, dtype=torch.float64)
        h_pre, h_post, logits = mapping(
            torch.ones(2, n * c, dtype=torch.float64),
            torch.zeros(big_n, n * c, dtype=torch.float64),
            zero,
            zero,
            zero,
            bias,
            n,
            "paper",
        )
        torch.testing.assert_close(h_pre[0], torch.sigmoid(bias[:n]))
        torch.testing.assert_close(h_post[0], 2 * torch.sigmoid(bias[n : 2 * n]))
        torch.testing.assert_close(logits[0], bias[2 * n :].view(n, n))
        assert logits[0, 0, 2] == 2 * n + 2 and logits[0, 2, 0] == 2 * n + 6


class TestPrecision:
    """Where each variant computes, and what dtype it hands back."""

    def _run(
        self, variant: str
    ) -> tuple[
        torch.Tensor,
        tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ]:
        torch.manual_seed(0)
        n, c = 4, 16
        w, alphas, bias = _params(n, c, torch.float32)
        x = torch.randn(8, n * c).to(torch.bfloat16)
        return x, mapping(x, w, *alphas, bias, n=n, variant=variant), (w, alphas, bias)

    def test_paper_keeps_fp32_coefficients(self):
        """paper: bf16 activations, fp32 coefficients."""
        _, (h_pre, h_post, logits), _ = self._run("paper")
        assert {h_pre.dtype, h_post.dtype, logits.dtype} == {torch.float32}

    def test_megatron_dev_computes_in_fp32_returns_activation_dtype(self):
        """megatron_dev: fp32 math, outputs cast back to bf16 (equal to fp32 math rounded once)."""
        x, (h_pre, _, logits), (w, alphas, bias) = self._run("megatron_dev")
        assert h_pre.dtype == torch.bfloat16 and logits.dtype == torch.bfloat16
        ref = mapping(x.float(), w, *alphas, bias, n=4, variant="megatron_dev")
        assert torch.equal(logits, ref[2].to(torch.bfloat16))

    def test_fp32_mappings_option_makes_megatron_main_compute_in_fp32(self):
        """megatron_main+fp32_mappings: fp32 math rounded once to bf16, as megatron_dev does it."""
        x, (_, _, logits), (w, alphas, bias) = self._run("megatron_main+fp32_mappings")
        assert logits.dtype == torch.bfloat16
        assert torch.equal(
            logits, mapping(x.float(), w, *alphas, bias, n=4, variant="megatron_main")[2].to(torch.bfloat16)
        )

    def test_activation_mappings_option_makes_megatron_dev_compute_in_bf16(self):
        """megatron_dev+activation_mappings: the projection in bf16, no longer the fp32 math rounded once."""
        x, (_, _, logits), (w, alphas, bias) = self._run("megatron_dev+activation_mappings")
        assert not torch.equal(
            logits, mapping(x.float(), w, *alphas, bias, n=4, variant="megatron_dev")[2].to(torch.bfloat16)
        )

    def test_megatron_main_computes_in_activation_dtype(self):
        """megatron_main: the projection runs in bf16, so it differs from the fp32 math."""
        x, (_, _, logits), (w, alphas, bias) = self._run("megatron_main")
        assert logits.dtype == torch.bfloat16
        ref = mapping(x.float(), w, *alphas, bias, n=4, variant="megatron_main")[2].to(torch.bfloat16)
        assert not torch.equal(logits, ref)


@pytest.mark.parametrize("variant", [*VARIANTS, *(f"{v}+eps_inside_sqrt" for v in VARIANTS)], ids=str)
def test_gradcheck_fp64(variant):
    """Gradients w.r.t. x, weight, the three alphas and bias equal finite differences."""
    n, c = 2, 3
    w, alphas, bias = _params(n, c)
    x = torch.randn(4, n * c, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, w, *alphas, bias))

    def fn(x, w, a_pre, a_post, a_res, b):
        return mapping(x, w, a_pre, a_post, a_res, b, n=n, variant=variant)

    assert torch.autograd.gradcheck(fn, inputs)


def test_empty_tokens():
    """T = 0 gives [0, n], [0, n], [0, n, n]."""
    n, c = 4, 8
    w, alphas, bias = _params(n, c, torch.float32)
    h_pre, h_post, logits = mapping(torch.zeros(0, n * c), w, *alphas, bias, n=n)
    assert h_pre.shape == (0, n) and h_post.shape == (0, n) and logits.shape == (0, n, n)


class TestBadInput:
    """Wrong shapes name the argument and the shapes received."""

    n, c = 4, 8

    def _args(self):
        w, alphas, bias = _params(self.n, self.c, torch.float32)
        return [torch.zeros(3, self.n * self.c), w, *alphas, bias, self.n]

    def test_x_rank(self):
        """x must be [T, n*C]."""
        args = self._args()
        args[0] = torch.zeros(3, 4, 8)
        with pytest.raises(ValueError, match=r"x must have shape \[T, n\*C\].*\[3, 4, 8\]"):
            mapping(*args)

    def test_width_not_divisible(self):
        """n*C must be a multiple of n."""
        args = self._args()
        args[0] = torch.zeros(3, 30)
        with pytest.raises(ValueError, match="n\\*C=30 is not a positive multiple of n=4"):
            mapping(*args)

    def test_weight_shape(self):
        """weight must be [N, n*C] with N = n*n + 2n."""
        args = self._args()
        args[1] = torch.zeros(20, 32)
        with pytest.raises(
            ValueError, match=r"weight must have shape \[N, n\*C\] = \[24, 32\], got \[20, 32\]"
        ):
            mapping(*args)

    def test_alpha_shape(self):
        """alphas are [1]."""
        args = self._args()
        args[3] = torch.zeros(2)
        with pytest.raises(ValueError, match=r"alpha_post must have shape \[1\]"):
            mapping(*args)

    @pytest.mark.parametrize("n", [0, -2], ids=lambda v: f"n{v}")
    def test_streams(self, n):
        """n < 1 is rejected."""
        args = self._args()
        args[-1] = n
        with pytest.raises(ValueError, match=f"n={n} must be an integer >= 1"):
            mapping(*args)
