"""The variants table: every documented difference is in it, and names resolve."""

from __future__ import annotations

import pytest

from mhc_core import VARIANTS, Variant, get_variant


def test_table_matches_the_design_table():
    """The knobs that distinguish the three variants, as in DESIGN.md."""
    p, m, d = (VARIANTS[v] for v in (Variant.PAPER, Variant.MEGATRON_MAIN, Variant.MEGATRON_DEV))
    assert (p.sinkhorn_start, m.sinkhorn_start, d.sinkhorn_start) == ("exp", "exp_rowmax", "softmax_eps")
    assert (p.sinkhorn_order, m.sinkhorn_order, d.sinkhorn_order) == ("col_row", "row_col", "row_col")
    assert (p.sinkhorn_guard, m.sinkhorn_guard, d.sinkhorn_guard) == ("none", "clamp", "add")
    assert (p.res_transposed, m.res_transposed, d.res_transposed) == (False, False, True)
    assert (p.h_pre_eps, m.h_pre_eps, d.h_pre_eps) == (0.0, 0.0, 1e-6)
    assert (p.mapping_fp32, m.mapping_fp32, d.mapping_fp32) == (True, False, True)
    assert (p.exact_sums, m.exact_sums, d.exact_sums) == ("rows", "cols", "none")
    assert (p.learned_contract, m.learned_contract, d.learned_contract) == (False, False, True)
    assert (p.params_fp32, m.params_fp32, d.params_fp32) == (True, False, True)


@pytest.mark.parametrize("name", ["paper", "megatron_main", "megatron_dev"])
def test_names_resolve(name):
    """Strings, enum members and specs all resolve to the same spec."""
    spec = get_variant(name)
    assert get_variant(Variant(name)) is spec and get_variant(spec) is spec
    assert str(Variant(name)) == name


def test_unknown_name():
    """An unknown name is a ValueError listing the valid ones."""
    with pytest.raises(ValueError, match="variant='main'.*valid: paper, megatron_main, megatron_dev"):
        get_variant("main")
