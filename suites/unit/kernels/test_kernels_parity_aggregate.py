"""h_aggregate: fused backends against `reference`, forward and both gradients."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch
from mhc_core.variants import Variant, get_variant
from suites.unit.kernels.parity import Case, backend_params, check_parity, device_for

FP32, BF16 = torch.float32, torch.bfloat16
CASES = (
    [Case(tokens=48, n=n, dtype=FP32) for n in (1, 2, 3, 4)]
    + [Case(tokens=1, n=4, dtype=FP32, extra="one-token")]
    + [Case(tokens=48, n=4, dtype=BF16)]
    + [Case(tokens=48, n=4, dtype=BF16, variant=Variant.PAPER, extra="fp32-coeff")]
)


def coeff_dtype(case: Case) -> torch.dtype:
    """The coefficient dtype the module hands this op: fp32 for `paper`, else the activation dtype."""
    return case.dtype if get_variant(case.variant).coefficients_in_activation_dtype else torch.float32


def _inputs(case: Case, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.tokens * 7 + case.n)
    x = torch.randn(case.tokens, case.n, case.hidden, generator=gen).to(case.dtype)
    h = torch.rand(case.tokens, case.n, generator=gen).to(coeff_dtype(case))
    return {"x": x.to(device), "h_pre": h.to(device)}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_h_aggregate_matches_reference(backend, case):
    """h_aggregate output and the grads of x and h_pre match the reference."""
    device = device_for(backend)
    check_parity(
        f"h_aggregate[{backend}, {case}]",
        ops.h_aggregate,
        dispatch.op_on("h_aggregate", backend),
        _inputs(case, device),
        ["x", "h_pre"],
        case.dtype,
    )


@pytest.mark.parametrize("backend", backend_params())
def test_h_aggregate_only_x_needs_grad(backend):
    """With h_pre frozen, only d(x) is computed and it matches the reference."""
    case = Case(tokens=48, n=4, dtype=FP32)
    device = device_for(backend)
    check_parity(
        f"h_aggregate[{backend}, x only]",
        ops.h_aggregate,
        dispatch.op_on("h_aggregate", backend),
        _inputs(case, device),
        ["x"],
        FP32,
    )
