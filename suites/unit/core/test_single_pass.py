"""Single-pass mHC (DeepSeek-V4.1): the form, its op, the module API that carries the mix, the fp64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

from mhc_core import (
    CONFIGURATIONS,
    ConnectionForm,
    HyperConnectionConfig,
    HyperConnectionModule,
    SinglePassMix,
    entry_mix,
    exit_aggregate,
    expand,
    get_variant,
    run_stack,
    single_pass_pre,
)
from mhc_core.ops import mapping, mix_dtype
from mhc_core.testing import assert_close, tolerance
from mhc_core.variants import CoefficientPrecision, NormEpsPlacement, configuration_name

V41 = "deepseek_v41"


def _hc(n=4, c=8, *, variant=V41, form="single_pass", seed=0, **kw) -> HyperConnectionModule:
    """A module whose coefficients are far from their init (random bias and alphas), so every part shows."""
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnectionModule(
        HyperConnectionConfig(hidden_size=c, num_residual_streams=n, variant=variant, form=form, **kw)
    )
    with torch.no_grad():
        hc.mapping_proj.weight.copy_(torch.randn(hc.mapping_proj.weight.shape, generator=g) * 0.3)
        hc.bias.copy_(torch.randn(hc.bias.shape, generator=g))
        for a in (hc.alpha_pre, hc.alpha_post, hc.alpha_res):
            a.fill_(0.5 + float(torch.rand(1, generator=g)))
    return hc


def _hand_v41(x, previous, weight, a_pre, a_post, a_res, bias, n, iterations, eps, sk_eps=1e-6):
    """DeepSeek-V4.1's equations written out per token with Python loops (fp64), from the report: the projection
    of x scaled by rsqrt(mean(x^2) + eps), sigmoid + 1e-6, 2 sigmoid, a row softmax + eps, one column step, then
    (row, column) x (iterations - 1); the aggregate with the previous H_pre (stream 0 without one)."""
    t, width = x.shape
    c = width // n
    agg, nxt, post, res = (
        torch.zeros(t, c, dtype=torch.float64),
        torch.zeros(t, n, dtype=torch.float64),
        torch.zeros(t, n, dtype=torch.float64),
        torch.zeros(t, n, n, dtype=torch.float64),
    )
    for i in range(t):
        xi = [float(v) for v in x[i]]
        r = 1.0 / math.sqrt(sum(v * v for v in xi) / width + eps)
        proj = [sum(float(weight[k, j]) * xi[j] for j in range(width)) * r for k in range(weight.shape[0])]
        for j in range(n):
            nxt[i, j] = 1 / (1 + math.exp(-(proj[j] * a_pre + float(bias[j])))) + 1e-6
            post[i, j] = 2 / (1 + math.exp(-(proj[n + j] * a_post + float(bias[n + j]))))
        z = [
            [proj[2 * n + r_ * n + c_] * a_res + float(bias[2 * n + r_ * n + c_]) for c_ in range(n)]
            for r_ in range(n)
        ]
        m = []
        for row in z:
            top = max(row)
            e = [math.exp(v - top) for v in row]
            m.append([v / sum(e) + sk_eps for v in e])

        def cols(m):
            s = [sum(m[r_][c_] for r_ in range(n)) + sk_eps for c_ in range(n)]
            return [[m[r_][c_] / s[c_] for c_ in range(n)] for r_ in range(n)]

        def rows(m):
            return [[v / (sum(row) + sk_eps) for v in row] for row in m]

        m = cols(m)
        for _ in range(iterations - 1):
            m = cols(rows(m))
        res[i] = torch.tensor(m, dtype=torch.float64)
        for k in range(c):
            if previous is None:
                agg[i, k] = xi[k]
            else:
                agg[i, k] = sum(float(previous[i, j]) * xi[j * c + k] for j in range(n))
    return agg, nxt, post, res


class TestConfiguration:
    """DeepSeek-V4.1's numerics are a named configuration; the form is separate from the numerics."""

    def test_deepseek_v41_is_dev_with_eps_inside_and_fp32_coefficients(self):
        """`deepseek_v41` = dev's Sinkhorn, gates and transposed mix, eps inside the sqrt, coefficients kept fp32."""
        spec = get_variant(V41)
        assert CONFIGURATIONS[V41] == spec.name == "megatron_dev+eps_inside_sqrt+fp32_coefficients"
        assert spec.norm_eps_placement == NormEpsPlacement.INSIDE_SQRT and spec.res_transposed
        assert spec.coefficient_precision == CoefficientPrecision.COMPUTE and spec.mapping_fp32
        assert configuration_name(spec) == V41 and configuration_name("megatron_dev") == "megatron_dev"

    def test_options_apply_on_top_of_a_named_configuration(self):
        """`deepseek_v41+untransposed_mix` is V4.1 with the mix untransposed (a mutant's name)."""
        spec = get_variant("deepseek_v41+untransposed_mix")
        assert not spec.res_transposed and spec.norm_eps_placement == NormEpsPlacement.INSIDE_SQRT

    def test_unknown_name_lists_the_configurations(self):
        """A bad name's error lists the named configurations beside the variants."""
        with pytest.raises(ValueError, match="deepseek_v41"):
            get_variant("deepseek_v4.1")

    @pytest.mark.parametrize(
        "variant,expected",
        [
            (V41, torch.float32),
            ("megatron_dev", torch.bfloat16),
            ("paper", torch.float32),
            ("megatron_main", torch.bfloat16),
        ],
    )
    def test_mix_dtype_follows_the_coefficient_precision(self, variant, expected):
        """The H_pre handed on from bf16 streams: fp32 where the coefficients stay in fp32, else bf16."""
        hc = _hc(variant=variant)
        x = torch.randn(3, 2, 32).to(torch.bfloat16)
        out = hc(x, previous_h_pre=None)
        assert (
            out.next_h_pre.dtype
            == out.h_res.dtype
            == out.h_post.dtype
            == expected
            == mix_dtype(variant, torch.bfloat16)
        )
        assert out.branch_input.dtype == torch.bfloat16

    def test_any_variant_runs_single_pass(self):
        """The form is not numerics: megatron_main runs single-pass, deepseek_v41 runs per sublayer."""
        x = torch.randn(3, 2, 32)
        main = _hc(variant="megatron_main")
        assert isinstance(main(x, previous_h_pre=None), SinglePassMix)
        v4 = _hc(form="per_sublayer")
        assert v4.hc_config.form == ConnectionForm.PER_SUBLAYER and len(v4(x)) == 4

    def test_learned_exit_is_refused_single_pass(self):
        """Single-pass exits with the last H_pre: a learned exit head is an error naming the field."""
        with pytest.raises(ValueError, match="output_contraction.*single_pass exits"):
            HyperConnectionConfig(hidden_size=8, variant="megatron_dev+learned_exit", form="single_pass")
        with pytest.raises(ValueError, match="HyperConnectionConfig.form='two_pass'"):
            HyperConnectionConfig(hidden_size=8, form="two_pass")


class TestOp:
    """`single_pass_pre` against the equations written out by hand, in fp64."""

    @pytest.mark.parametrize("previous", ["entry", "mix"])
    def test_matches_the_hand_computation(self, previous):
        """n = 3 (so the orientation of H_res shows), T = 2, C = 2, three iterations, eps = 1e-5."""
        g = torch.Generator().manual_seed(3)
        n, c, t, it, eps = 3, 2, 2, 3, 1e-5
        x = torch.randn(t, n * c, generator=g, dtype=torch.float64)
        w = torch.randn(n * n + 2 * n, n * c, generator=g, dtype=torch.float64)
        bias = torch.randn(n * n + 2 * n, generator=g, dtype=torch.float64)
        a = [torch.tensor([v], dtype=torch.float64) for v in (0.7, 1.1, 0.9)]
        prev = None if previous == "entry" else torch.rand(t, n, generator=g, dtype=torch.float64)
        got = single_pass_pre(x, prev, w, a[0], a[1], a[2], bias, n, it, V41, eps)
        want = _hand_v41(x, prev, w, 0.7, 1.1, 0.9, bias, n, it, eps)
        for name, gv, wv in zip(("aggregate", "next_h_pre", "h_post", "h_res"), got, want, strict=True):
            assert_close(name, gv, wv, tolerance(torch.float64))

    def test_aggregate_uses_the_previous_mix_not_its_own(self):
        """The branch input depends on previous_h_pre only through the aggregate; its own H_pre is handed on."""
        hc = _hc()
        x = torch.randn(4, 1, 32, dtype=torch.float32)
        prev = torch.rand(4, 1, 4)
        out = hc(x, previous_h_pre=prev)
        streams = x.view(4, 1, 4, 8)
        assert_close(
            "branch", out.branch_input, torch.einsum("sbn,sbnc->sbc", prev, streams), tolerance(torch.float32)
        )
        own = hc(x, previous_h_pre=out.next_h_pre).branch_input
        assert (
            float((own - out.branch_input).detach().abs().max()) > 1e-3
        )  # its own H_pre would give another input

    def test_entry_is_stream_zero_exactly(self):
        """No predecessor: the branch input is stream 0 bit for bit, and the gradient reaches stream 0 only."""
        hc = _hc()
        x = torch.randn(3, 2, 32, requires_grad=True)
        out = hc(x, previous_h_pre=None)
        assert torch.equal(out.branch_input, x.view(3, 2, 4, 8)[:, :, 0])
        (g,) = torch.autograd.grad(out.branch_input.sum(), x)
        g = g.view(3, 2, 4, 8)
        assert torch.equal(g[:, :, 0], torch.ones(3, 2, 8)) and not g[:, :, 1:].any()
        one_hot = entry_mix((3, 2), 4)
        assert torch.equal(hc(x, previous_h_pre=one_hot).branch_input, out.branch_input)

    def test_next_h_pre_is_the_mapping_h_pre(self):
        """The H_pre handed on is exactly what the per-sublayer form aggregates with (the same projection)."""
        hc = _hc()
        x = torch.randn(5, 32)
        _, nxt, _, _ = single_pass_pre(
            x, None, hc.mapping_proj.weight, hc.alpha_pre, hc.alpha_post, hc.alpha_res, hc.bias, 4, 20, V41
        )
        h_pre, _, _ = mapping(
            x, hc.mapping_proj.weight, hc.alpha_pre, hc.alpha_post, hc.alpha_res, hc.bias, 4, V41
        )
        assert torch.equal(nxt, h_pre)

    def test_gradcheck(self):
        """fp64 gradients with respect to the streams, the previous mix and every parameter."""
        g = torch.Generator().manual_seed(5)
        n, c, t = 3, 2, 2

        def leaf(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

        x, prev, w, bias = leaf(t, n * c), leaf(t, n), leaf(n * n + 2 * n, n * c), leaf(n * n + 2 * n)
        a = [torch.tensor([v], dtype=torch.float64, requires_grad=True) for v in (0.7, 1.1, 0.9)]

        def op(x, prev, w, a_pre, a_post, a_res, bias):
            return single_pass_pre(x, prev, w, a_pre, a_post, a_res, bias, n, 4, V41)

        assert torch.autograd.gradcheck(op, (x, prev, w, *a, bias))

    @pytest.mark.parametrize(
        "bad,match",
        [
            (torch.rand(3, 2, 5), r"previous_h_pre must have shape \[s, b, n\]"),
            (torch.rand(3, 2), r"previous_h_pre must have shape \[s, b, n\] \(3 dims\)"),
            (torch.ones(3, 2, 4, dtype=torch.int64), "previous_h_pre must be a floating tensor"),
        ],
    )
    def test_bad_previous_mix_is_named(self, bad, match):
        """A previous H_pre of the wrong shape or dtype: a ValueError naming it and its layout."""
        with pytest.raises(ValueError, match=match):
            _hc()(torch.randn(3, 2, 32), previous_h_pre=bad)

    def test_the_form_decides_the_call(self):
        """A single-pass module needs previous_h_pre; a per-sublayer one refuses it; each error says which."""
        x = torch.randn(3, 2, 32)
        with pytest.raises(ValueError, match="this module is single_pass"):
            _hc()(x)
        with pytest.raises(ValueError, match="previous_h_pre is for the single_pass form"):
            _hc(form="per_sublayer")(x, previous_h_pre=None)

    def test_exit_aggregate_checks_the_last_mix(self):
        """The exit needs the last H_pre `[s, b, n]`: None or a wrong shape is an error naming `last_h_pre`."""
        x = torch.randn(3, 2, 32)
        with pytest.raises(ValueError, match="last_h_pre is None"):
            exit_aggregate(x, None, 4)
        with pytest.raises(ValueError, match=r"last_h_pre must have shape \[s, b, n\]"):
            exit_aggregate(x, torch.rand(3, 2, 3), 4)

    def test_the_module_keeps_nothing_of_a_call(self):
        """Two calls with different mixes are independent: no tensor of a call stays on the module."""
        hc = _hc()
        before = {k: v for k, v in vars(hc).items() if not k.startswith("_")}
        x = torch.randn(3, 2, 32)
        p1, p2 = torch.rand(3, 2, 4), torch.rand(3, 2, 4)
        a = hc(x, previous_h_pre=p1).branch_input
        hc(x, previous_h_pre=p2)
        assert torch.equal(hc(x, previous_h_pre=p1).branch_input, a)
        after = {k: v for k, v in vars(hc).items() if not k.startswith("_")}
        assert after.keys() == before.keys()
        assert not [k for k, v in vars(hc).items() if isinstance(v, torch.Tensor)]


def _stack(dtype, depth=4, n=4, c=8, variant=V41, form="single_pass"):
    hcs = [_hc(n, c, variant=variant, form=form, seed=k).to(dtype) for k in range(depth)]
    g = torch.Generator().manual_seed(11)
    ws = [(torch.randn(c, c, generator=g, dtype=torch.float64) / c**0.5) for _ in range(depth)]
    branches = [lambda a, w=w: torch.tanh(a @ w.to(a.dtype)) for w in ws]
    return hcs, branches, ws


class TestStack:
    """`run_stack` in the single-pass form against a stack written out by hand; fp32 and bf16 against fp64."""

    def test_fp64_stack_matches_the_hand_loop(self):
        """Four sublayers: expand, each aggregate with the previous H_pre (stream 0 first), the exit with the last."""
        hcs, branches, _ = _stack(torch.float64)
        h = torch.randn(3, 2, 8, dtype=torch.float64)
        x = expand(h, 4).view(6, 32)
        prev = None
        for hc, f in zip(hcs, branches, strict=True):
            p = [
                v.detach()
                for v in (hc.mapping_proj.weight, hc.alpha_pre, hc.alpha_post, hc.alpha_res, hc.bias)
            ]
            agg, nxt, post, res = _hand_v41(
                x, prev, p[0], float(p[1]), float(p[2]), float(p[3]), p[4], 4, 20, 1e-6
            )
            y = f(agg)
            streams = x.view(6, 4, 8)
            x = (torch.einsum("tji,tjc->tic", res, streams) + post.unsqueeze(-1) * y.unsqueeze(1)).reshape(
                6, 32
            )
            prev = nxt
        want = torch.einsum("tn,tnc->tc", prev, x.view(6, 4, 8)).view(3, 2, 8)
        assert_close("stack", run_stack(h, hcs, branches), want, tolerance(torch.float64))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_stack_in_low_precision_is_close_to_the_oracle(self, dtype):
        """The same weights in fp32 / bf16 (mHC parameters kept fp32): the error relative to the output's largest
        entry stays within two ulps of the dtype per sublayer (bf16: 6.0e-3 measured over four sublayers, bound 3.1e-2)."""
        oracle_hcs, branches, _ = _stack(torch.float64)
        hcs, _, _ = _stack(torch.float32)
        h = torch.randn(3, 2, 8, dtype=torch.float64)
        want = run_stack(h, oracle_hcs, branches)
        got = run_stack(h.to(dtype), hcs, branches)
        assert got.dtype == dtype
        err = float((got.double() - want).detach().abs().max() / want.detach().abs().max())
        bound = 4 * len(hcs) * torch.finfo(dtype).eps / 2
        assert err <= bound, f"{dtype}: stack error {err:.3e} relative to max |oracle| > {bound:.3e}"

    def test_gradient_reaches_every_parameter_through_the_handoff(self):
        """The H_pre rows of each projection (and alpha_pre) get a gradient only through the next sublayer's
        aggregate (the last one's through the exit): every parameter of every sublayer gets a non-zero one."""
        hcs, branches, _ = _stack(torch.float64)
        h = torch.randn(3, 2, 8, dtype=torch.float64)
        run_stack(h, hcs, branches).square().sum().backward()
        for k, hc in enumerate(hcs):
            for name, p in hc.named_parameters():
                assert p.grad is not None and bool(p.grad.abs().sum() > 0), (
                    f"sublayer {k} {name}: no gradient"
                )
            assert bool(hc.mapping_proj.weight.grad[:4].abs().sum() > 0), f"sublayer {k}: H_pre rows got none"

    def test_first_h_pre_rows_reach_only_the_next_sublayer(self):
        """Cut the handoff (each sublayer fed a constant mix): the H_pre rows of the projections get no gradient,
        which is what makes the handoff observable."""
        hcs, branches, _ = _stack(torch.float64)
        h = torch.randn(3, 2, 8, dtype=torch.float64)
        x = expand(h, 4)
        for hc, f in zip(hcs, branches, strict=True):
            agg, h_res, h_post, _ = hc(x, previous_h_pre=torch.full((3, 2, 4), 0.25, dtype=torch.float64))
            x = hc.post_residual_bda(h_res, x, h_post, (f(agg), None))
        x.square().sum().backward()
        assert all(not hc.alpha_pre.grad.any() and not hc.mapping_proj.weight.grad[:4].any() for hc in hcs)

    def test_mixed_forms_are_refused(self):
        """A stack of one single-pass and one per-sublayer connection is an error naming both forms."""
        hcs = [_hc(), _hc(form="per_sublayer")]
        with pytest.raises(ValueError, match="one form and one n"):
            run_stack(torch.randn(2, 1, 8), hcs, [torch.tanh, torch.tanh])
