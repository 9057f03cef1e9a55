"""The variants table: every documented difference is in it, and names resolve."""

from __future__ import annotations

import pytest

from mhc_core import VARIANTS, Variant, get_variant
from mhc_core.variants import (
    MappingPrecision,
    NormEpsPlacement,
    NumericsOptions,
    OutputContraction,
    configure,
)


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
    assert (p.params_fp32, m.params_fp32, d.params_fp32) == (True, False, True)
    assert {s.norm_eps_placement for s in (p, m, d)} == {NormEpsPlacement.OUTSIDE_SQRT}
    assert {s.output_contraction for s in (p, m, d)} == {OutputContraction.MEAN}
    assert (p.name, m.name, d.name) == ("paper", "megatron_main", "megatron_dev")


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


@pytest.mark.parametrize(
    ("name", "eps", "fp32", "exit_"),
    [
        ("megatron_dev+eps_inside_sqrt", NormEpsPlacement.INSIDE_SQRT, True, OutputContraction.MEAN),
        (
            "megatron_dev+eps_inside_sqrt+learned_exit",
            NormEpsPlacement.INSIDE_SQRT,
            True,
            OutputContraction.LEARNED,
        ),
        ("megatron_main+fp32_mappings", NormEpsPlacement.OUTSIDE_SQRT, True, OutputContraction.MEAN),
        (
            "paper+activation_mappings+learned_exit",
            NormEpsPlacement.OUTSIDE_SQRT,
            False,
            OutputContraction.LEARNED,
        ),
    ],
)
def test_configuration_names_resolve(name, eps, fp32, exit_):
    """`<variant>+<option>...` resolves to the variant with those options, and names itself back."""
    spec = get_variant(name)
    assert (spec.norm_eps_placement, spec.mapping_fp32, spec.params_fp32, spec.output_contraction) == (
        eps,
        fp32,
        fp32,
        exit_,
    )
    assert spec.name == name and get_variant(spec.name) == spec
    base = VARIANTS[spec.variant]  # every other knob is the variant's
    assert (spec.sinkhorn_start, spec.res_transposed, spec.h_pre_eps) == (
        base.sinkhorn_start,
        base.res_transposed,
        base.h_pre_eps,
    )


def test_an_option_equal_to_the_variants_own_is_not_named():
    """Options that change nothing give the variant itself (so `megatron_dev+fp32_mappings` is `megatron_dev`)."""
    assert get_variant("megatron_dev+fp32_mappings") is VARIANTS[Variant.MEGATRON_DEV]
    assert (
        configure("megatron_main", NumericsOptions(mapping_precision=MappingPrecision.ACTIVATION)).name
        == "megatron_main"
    )
    assert (
        configure("paper", NumericsOptions(norm_eps_placement="inside_sqrt")).name == "paper+eps_inside_sqrt"
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("megatron_dev+eps_inside", "unknown option 'eps_inside'; options: eps_inside_sqrt"),
        ("megatron_dev+learned_exit+mean_exit", "'learned_exit' and 'mean_exit' set the same option"),
        ("dev+learned_exit", "variant='dev\\+learned_exit' is not a known mHC variant"),
    ],
)
def test_bad_configuration_names(name, message):
    """An unknown option, two values of one option or an unknown variant is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        get_variant(name)


def test_bad_option_value():
    """A value that is not one of an option's choices is a ValueError naming the field and the choices."""
    with pytest.raises(ValueError, match="NumericsOptions.norm_eps_placement='inside'.*inside_sqrt"):
        NumericsOptions(norm_eps_placement="inside")


def test_residual_mix_option_flips_the_orientation():
    """megatron_dev+untransposed_mix mixes H @ x (as megatron_main), megatron_main+transposed_mix H^T @ x."""
    import torch

    from mhc_core import h_post_bda

    g = torch.Generator().manual_seed(0)
    h, x = (
        torch.rand(2, 3, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
    )
    post, y = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
    mix = lambda v: h_post_bda(h, x, post, y, None, variant=v)  # noqa: E731
    assert torch.equal(mix("megatron_dev+untransposed_mix"), mix("megatron_main"))
    assert torch.equal(mix("megatron_main+transposed_mix"), mix("megatron_dev"))
    assert get_variant("megatron_dev+untransposed_mix").name == "megatron_dev+untransposed_mix"


def test_input_dtype_sinkhorn_iterates_in_the_logits_dtype():
    """`+input_dtype_sinkhorn` normalises bf16 logits in bf16 at every step (each step's rounding shows against the
    fp32-iterated result, rounded once), leaves fp32 logits as they were, and every backend computes it: the
    compiled one runs the reference for it, bit for bit."""
    import torch

    from mhc_core import ops
    from mhc_core.kernels import dispatch
    from mhc_core.ops.sinkhorn import sinkhorn_iterate
    from mhc_core.variants import SinkhornPrecision

    spec = get_variant("megatron_main+input_dtype_sinkhorn")
    assert spec.sinkhorn_precision == SinkhornPrecision.INPUT and spec.sinkhorn_in_input_dtype
    assert spec.name == "megatron_main+input_dtype_sinkhorn"
    assert get_variant("megatron_main+fp32_sinkhorn") == get_variant("megatron_main")
    z = 3 * torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(1))
    bf = z.to(torch.bfloat16)
    got = ops.sinkhorn(bf, 20, None, spec)
    assert torch.equal(got, sinkhorn_iterate(bf, 20, 1e-6, spec))
    once = ops.sinkhorn(bf, 20, None, "megatron_main")
    assert not torch.equal(got, once)
    assert float((got.float() - once.float()).abs().max()) < 3e-2  # bf16 rounding, not another algorithm
    assert torch.equal(ops.sinkhorn(z, 20, None, spec), ops.sinkhorn(z, 20, None, "megatron_main"))
    compiled = dispatch.op_on("sinkhorn", "compiled")
    assert torch.equal(compiled(bf, 20, None, spec), got)
