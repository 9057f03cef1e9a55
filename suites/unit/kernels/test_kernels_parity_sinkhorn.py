"""Sinkhorn: every fused backend against `reference`, forward and gradient, every variant."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch
from mhc_core.variants import Variant
from suites.unit.kernels.parity import Case, backend_params, check_parity, device_for

ITERATIONS = 4
"""Parity runs use 4 iterations: the unrolled graph is the same code at 20, and its compile time grows with the
iteration count. The default 20 runs on the compiled backend in the conformance matrix (`mhc_core[<variant>,compiled]`:
`sinkhorn s<S> it20` and `coefficients`, every variant, forward and gradient against fp64) and in the fused
functional run (`suites/functional/test_fused_mhc.py`)."""

FP32, BF16 = torch.float32, torch.bfloat16
CASES = (
    [Case(tokens=48, n=4, dtype=dt, variant=v) for v in Variant for dt in (FP32, BF16)]
    + [Case(tokens=40, n=2, dtype=FP32, variant=Variant.MEGATRON_MAIN)]
    + [Case(tokens=40, n=n, dtype=FP32, variant=Variant.MEGATRON_DEV) for n in (1, 3)]
)
"""Every variant at n = 4 in fp32 and bf16 (bf16 shares the fp32 graph: the op upcasts first);
n = 2 and 3 on one variant each (the same code with another static n); n = 1 runs the reference."""


def _logits(case: Case, device: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.tokens * 31 + case.n)
    shape = shape or (case.tokens, case.n, case.n)
    return (2.0 * torch.randn(shape, generator=gen)).to(case.dtype).to(device)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_sinkhorn_matches_reference(backend, case):
    """sinkhorn output and d(logits) match the reference."""
    device = device_for(backend)
    check_parity(
        f"sinkhorn[{backend}, {case}]",
        ops.sinkhorn,
        dispatch.op_on("sinkhorn", backend),
        {"logits": _logits(case, device)},
        ["logits"],
        case.dtype,
        iterations=ITERATIONS,
        eps=None,
        variant=case.variant,
    )


@pytest.mark.parametrize("backend", backend_params())
def test_sinkhorn_batched_logits(backend):
    """Logits shaped [s, b, n, n] give the reference's output and gradient."""
    case = Case(tokens=48, n=4, dtype=FP32, variant=Variant.PAPER)
    device = device_for(backend)
    check_parity(
        f"sinkhorn[{backend}, s6-b8]",
        ops.sinkhorn,
        dispatch.op_on("sinkhorn", backend),
        {"logits": _logits(case, device, (6, 8, 4, 4))},
        ["logits"],
        FP32,
        iterations=ITERATIONS,
        eps=None,
        variant=case.variant,
    )


def test_compiled_sinkhorn_of_a_new_form_matches_reference():
    """A Sinkhorn form no variant has (main's start, the paper's order, dev's guard; the unit suite's
    `test_variant_table.py`) runs on the compiled backend from the table's fields: output and d(logits) match
    the reference, the rowmax's gradient included (a first column step does not cancel it)."""
    import dataclasses

    from mhc_core.variants import VARIANTS

    ok, why = dispatch.availability("compiled", "cpu")
    if not ok:
        pytest.skip(why)
    spec = dataclasses.replace(
        VARIANTS[Variant.MEGATRON_MAIN], sinkhorn_order="col_row", sinkhorn_guard="add", exact_sums="rows"
    )
    case = Case(tokens=48, n=4, dtype=FP32)
    check_parity(
        "sinkhorn[compiled, new form]",
        ops.sinkhorn,
        dispatch.op_on("sinkhorn", "compiled"),
        {"logits": _logits(case, "cpu")},
        ["logits"],
        FP32,
        iterations=ITERATIONS,
        eps=None,
        variant=spec,
    )
