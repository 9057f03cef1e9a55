"""The variant table is what the backends read: a variant that recombines its Sinkhorn fields runs on the
reference op with no code of its own, the compiled backend agrees with it, and a form no cuTile kernel
computes is named; impossible combinations are refused where the table is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels.cutile.runtime import SINKHORN_FORM_CODE, sinkhorn_code
from mhc_core.variants import VARIANTS, Variant

NEW_FORM = dataclasses.replace(
    VARIANTS[Variant.MEGATRON_MAIN], sinkhorn_order="col_row", sinkhorn_guard="add", exact_sums="rows"
)
"""A Sinkhorn form no variant has: main's start, the paper's order, dev's additive guard."""


def _by_hand(z: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """`exp(Z - rowmax)`, then `iterations` times column / (colsum + eps), row / (rowsum + eps)."""
    m = torch.exp(z - z.amax(dim=-1, keepdim=True))
    for _ in range(iterations):
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
    return m


def test_a_new_sinkhorn_form_runs_on_the_reference_from_its_fields():
    """The reference Sinkhorn of the new form equals the hand-written iteration bit for bit, forward, and its
    gradient matches autograd of that iteration."""
    z = torch.randn(16, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    got = ops.sinkhorn(z, 7, None, NEW_FORM)
    want = _by_hand(z, 7, NEW_FORM.sinkhorn_eps)
    assert torch.equal(got, want), float((got - want).abs().max())
    rows = (got.sum(-1) - 1).abs().max()
    assert rows < 1e-5, float(rows)  # rows normalised last: 1 - eps at most
    zl = z.clone().requires_grad_(True)
    g = torch.randn_like(z)
    (a,) = torch.autograd.grad(ops.sinkhorn(zl, 7, None, NEW_FORM), zl, g)
    (b,) = torch.autograd.grad(_by_hand(zl, 7, NEW_FORM.sinkhorn_eps), zl, g)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_variants_own_forms_map_to_the_kernels_codes_and_a_new_one_is_named():
    """Each variant's Sinkhorn form has a cuTile kernel code; the new form is refused naming its fields."""
    assert {sinkhorn_code(spec) for spec in VARIANTS.values()} == set(SINKHORN_FORM_CODE.values())
    with pytest.raises(NotImplementedError, match=r"\('exp_rowmax', 'col_row', 'add'\) of megatron_main"):
        sinkhorn_code(NEW_FORM)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sinkhorn_start": "exp", "sinkhorn_guard": "clamp"}, "log domain"),
        ({"sinkhorn_start": "softmax_eps", "sinkhorn_order": "col_row"}, "must be 'row_col'"),
    ],
)
def test_impossible_sinkhorn_combinations_are_refused(change, message):
    """A log-domain start with a guard, or a softmax start before a column step, is refused naming the fields."""
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(VARIANTS[Variant.MEGATRON_MAIN], **change)
