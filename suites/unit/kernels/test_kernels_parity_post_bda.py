"""h_post_bda: fused backends against `reference`, forward and all five gradients, every variant."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch
from mhc_core.variants import Variant, get_variant
from suites.unit.kernels.parity import Case, backend_params, check_parity, device_for

FP32, BF16 = torch.float32, torch.bfloat16
CASES = (
    [Case(tokens=48, n=4, dtype=dt, variant=v) for v in Variant for dt in (FP32, BF16)]
    + [Case(tokens=40, n=2, dtype=FP32, variant=v) for v in Variant]
    + [Case(tokens=40, n=3, dtype=FP32, variant=v) for v in (Variant.MEGATRON_MAIN, Variant.MEGATRON_DEV)]
    + [Case(tokens=40, n=1, dtype=FP32)]
)
"""Every variant at n = 2 and 4 (fp32) and n = 4 (bf16); orientation at n = 3 both ways; n = 1.
In fp32, paper and megatron_main differ only by name here (same orientation): they share a graph."""
GRADS = ["h_res", "residual", "h_post", "y", "bias"]


def coeff_dtype(case: Case) -> torch.dtype:
    """The coefficient dtype the module hands this op: fp32 for `paper`, else the activation dtype."""
    return case.dtype if get_variant(case.variant).coefficients_in_activation_dtype else torch.float32


def _inputs(case: Case, device: str, with_bias: bool = True) -> dict[str, torch.Tensor | None]:
    """An arbitrary (not doubly stochastic) h_res, so a wrong orientation cannot pass at n >= 2."""
    gen = torch.Generator().manual_seed(case.tokens * 13 + case.n)
    t, n, c = case.tokens, case.n, case.hidden
    coeff = coeff_dtype(case)
    t_in = {
        "h_res": torch.rand(t, n, n, generator=gen).to(coeff),
        "residual": torch.randn(t, n, c, generator=gen).to(case.dtype),
        "h_post": (2.0 * torch.rand(t, n, generator=gen)).to(coeff),
        "y": torch.randn(t, c, generator=gen).to(case.dtype),
        "bias": torch.randn(c, generator=gen).to(case.dtype) if with_bias else None,
    }
    return {k: None if v is None else v.to(device) for k, v in t_in.items()}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_h_post_bda_matches_reference(backend, case):
    """h_post_bda output and the grads of h_res, residual, h_post, y and bias match the reference."""
    device = device_for(backend)
    check_parity(
        f"h_post_bda[{backend}, {case}]",
        ops.h_post_bda,
        dispatch.get_impl("h_post_bda", backend),
        _inputs(case, device),
        GRADS,
        case.dtype,
        cosine_groups=[["bias"]],
        dropout_p=0.0,
        training=True,
        variant=case.variant,
    )


@pytest.mark.parametrize("backend", backend_params())
def test_h_post_bda_without_bias(backend):
    """bias=None: output and the four remaining grads match the reference."""
    case = Case(tokens=48, n=4, dtype=FP32)
    device = device_for(backend)
    check_parity(
        f"h_post_bda[{backend}, no bias]",
        ops.h_post_bda,
        dispatch.get_impl("h_post_bda", backend),
        _inputs(case, device, with_bias=False),
        GRADS,
        FP32,
        dropout_p=0.0,
        training=False,
        variant=case.variant,
    )


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_compiled_h_post_bda_dropout_runs_the_reference(variant):
    """dropout_p > 0 while training: the compiled backend returns the reference formulation, same RNG draw."""
    case = Case(tokens=16, n=4, dtype=FP32, variant=variant)
    inputs = _inputs(case, "cpu")
    torch.manual_seed(7)
    expected = ops.h_post_bda(**inputs, dropout_p=0.25, training=True, variant=variant)
    torch.manual_seed(7)
    got = dispatch.get_impl("h_post_bda", "compiled")(**inputs, dropout_p=0.25, training=True, variant=variant)
    assert torch.equal(got, expected), f"max abs diff {(got - expected).abs().max().item():.3e}"
