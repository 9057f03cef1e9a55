"""mapping (projection + RMS + coefficients): fused backends against `reference`, all gradients."""

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
    + [Case(tokens=40, n=2, dtype=FP32, variant=v) for v in (Variant.PAPER, Variant.MEGATRON_MAIN)]
    + [Case(tokens=40, n=n, dtype=FP32, variant=Variant.MEGATRON_DEV) for n in (1, 3)]
    + [
        Case(tokens=48, n=4, dtype=dt, variant=get_variant(name), extra="rms1e-3")
        for name, dt in (
            ("megatron_dev+eps_inside_sqrt", FP32),
            ("megatron_main+eps_inside_sqrt+fp32_mappings", BF16),
            ("megatron_main+dtype_eps_inside_sqrt", FP32),
        )
    ]
)
"""Every variant at n = 4 in fp32 and bf16; n = 1, 2, 3 in fp32 (fp32 paper and megatron_main share a graph);
the eps inside the square root (with x at RMS 1e-3, where its placement shows), the dtype's eps there, and fp32
mappings on main."""
GRADS = ["x", "weight", "alpha_pre", "alpha_post", "alpha_res", "bias"]
COSINE = [["alpha_pre", "alpha_post", "alpha_res"], ["bias"], ["weight"]]


def _inputs(case: Case, device: str) -> dict[str, torch.Tensor]:
    """x `[T, n*C]` in the case dtype; fp32 parameters with gates large enough to matter."""
    gen = torch.Generator().manual_seed(case.tokens * 17 + case.n)
    n, k = case.n, case.n * case.hidden
    big_n = n * n + 2 * n

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(shape, generator=gen)

    t = {
        "x": (rnd(case.tokens, k) * (1e-3 if case.extra == "rms1e-3" else 1.0)).to(case.dtype),
        "weight": rnd(big_n, k, scale=k**-0.5),
        "alpha_pre": 0.5 + torch.rand(1, generator=gen),
        "alpha_post": 0.5 + torch.rand(1, generator=gen),
        "alpha_res": 0.5 + torch.rand(1, generator=gen),
        "bias": rnd(big_n, scale=0.3),
    }
    return {name: v.to(device) for name, v in t.items()}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_mapping_matches_reference(backend, case):
    """h_pre, h_post, h_res_logits and the grads of x, weight, the alphas and bias match the reference."""
    device = device_for(backend)
    check_parity(
        f"mapping[{backend}, {case}]",
        ops.mapping,
        dispatch.op_on("mapping", backend),
        _inputs(case, device),
        GRADS,
        case.dtype,
        cosine_groups=COSINE,
        n=case.n,
        variant=case.variant,
    )


@pytest.mark.parametrize("backend", backend_params())
def test_mapping_zero_token_row(backend):
    """A token whose x is all zeros (rms = 0) gives the reference's finite outputs and gradients."""
    case = Case(tokens=48, n=4, dtype=FP32)
    device = device_for(backend)
    inputs = _inputs(case, device)
    inputs["x"][3] = 0.0
    check_parity(
        f"mapping[{backend}, zero row]",
        ops.mapping,
        dispatch.op_on("mapping", backend),
        inputs,
        GRADS,
        FP32,
        n=case.n,
        variant=case.variant,
    )


@pytest.mark.parametrize("backend", backend_params())
def test_mapping_bf16_parameters_of_megatron_main(backend):
    """megatron_main under Float16Module: bf16 x and bf16 parameters (cast with the model) match the reference."""
    case = Case(tokens=48, n=4, dtype=BF16, variant=Variant.MEGATRON_MAIN)
    device = device_for(backend)
    inputs = {k: v.to(BF16) for k, v in _inputs(case, device).items()}
    check_parity(
        f"mapping[{backend}, {case}, bf16 params]",
        ops.mapping,
        dispatch.op_on("mapping", backend),
        inputs,
        GRADS,
        BF16,
        cosine_groups=COSINE,
        n=case.n,
        variant=case.variant,
    )
