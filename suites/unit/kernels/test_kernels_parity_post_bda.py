"""h_post_bda: fused backends against `reference`, forward and all five gradients, every variant."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch
from mhc_core.kernels.compiled.dropout import draw_seed, keep_mask
from mhc_core.ops.post_bda import apply_h_res
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
        dispatch.op_on("h_post_bda", backend),
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
        dispatch.op_on("h_post_bda", backend),
        _inputs(case, device, with_bias=False),
        GRADS,
        FP32,
        dropout_p=0.0,
        training=False,
        variant=case.variant,
    )


P = 0.25
COMPILED_OK, COMPILED_WHY = dispatch.availability("compiled", device_for("compiled"))
needs_compiled = pytest.mark.skipif(not COMPILED_OK, reason=COMPILED_WHY)
DROPOUT_CASES = [
    Case(tokens=48, n=4, dtype=FP32, variant=Variant.MEGATRON_MAIN, extra="p0.25"),
    Case(tokens=48, n=4, dtype=BF16, variant=Variant.MEGATRON_DEV, extra="p0.25"),
]
"""Both orientations, both dtypes, one graph pair each (the dropout rate is part of the compile key)."""


def _with_mask(keep: torch.Tensor, p: float):
    """The reference formulation of h_post_bda with the given keep mask `[T, n, C]` in place of its dropout draw."""

    def fn(h_res, residual, h_post, y, bias, variant):
        mix = apply_h_res(h_res, residual, get_variant(variant).res_transposed)
        acc = mix.dtype
        branch_in = y.to(acc) if bias is None else y.to(acc) + bias.to(acc)
        branch = h_post.to(acc).unsqueeze(-1) * branch_in.unsqueeze(-2)
        return (mix + torch.where(keep, branch * (1.0 / (1.0 - p)), 0.0)).to(residual.dtype)

    return fn


def _seeded_compiled(seed: int, **fixed):
    impl = dispatch.op_on("h_post_bda", "compiled")

    def fn(**kwargs):
        torch.manual_seed(seed)
        return impl(**kwargs, **fixed)

    return fn


def _mask(inputs: dict, seed: int, variant: Variant, training: bool = True) -> torch.Tensor | None:
    """The keep mask the compiled backend draws under `seed`, rebuilt from the int32 seed it saves for
    its backward (None: no dropout, no seed saved)."""
    leaves = {k: None if v is None else v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    out = _seeded_compiled(seed, dropout_p=P, training=training, variant=variant)(**leaves)
    saved = out.grad_fn.saved_tensors[-1]
    assert saved is None or (saved.dtype == torch.int32 and saved.dim() == 0), saved
    return None if saved is None else keep_mask(saved, tuple(out.shape), P)


@needs_compiled
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=str)
def test_compiled_h_post_bda_dropout_matches_the_formula_with_its_mask(case):
    """Training dropout (p = 0.25) is fused: the output and all five grads equal the reference
    formulation with the keep mask rebuilt from the seed the compiled backend saved for backward."""
    inputs = _inputs(case, device_for("compiled"))
    keep = _mask(inputs, 11, case.variant)
    check_parity(
        f"h_post_bda[compiled, dropout {P}, {case}]",
        _with_mask(keep, P),
        _seeded_compiled(11, dropout_p=P, training=True),
        inputs,
        GRADS,
        case.dtype,
        cosine_groups=[["bias"]],
        variant=case.variant,
    )


@needs_compiled
def test_compiled_h_post_bda_dropout_mask_is_seeded_with_rate_p():
    """The mask replays under the same seed, changes with the seed, keeps 1 - p of the elements
    (within 5 sigma), and eval mode (training=False) draws none."""
    case = DROPOUT_CASES[0]
    inputs = _inputs(case, device_for("compiled"))
    a, b, other = (
        _mask(inputs, 11, case.variant),
        _mask(inputs, 11, case.variant),
        _mask(inputs, 12, case.variant),
    )
    assert torch.equal(a, b)
    assert not torch.equal(a, other)
    frac, sigma = a.float().mean().item(), ((1 - P) * P / a.numel()) ** 0.5
    assert abs(frac - (1 - P)) < 5 * sigma, (
        f"kept {frac:.4f} of {a.numel()}, expected {1 - P} +- {5 * sigma:.4f}"
    )
    assert _mask(inputs, 11, case.variant, training=False) is None


def test_keep_mask_is_uniform_and_uncorrelated():
    """The hash mask keeps 1 - p at several p, and neighbours along C, across streams and across
    tokens agree as often as independent draws would (within 5 sigma)."""
    torch.manual_seed(3)
    shape = (256, 4, 512)
    for p in (0.1, 0.25, 0.5):
        keep = keep_mask(draw_seed("cpu"), shape, p).float()
        sigma = ((1 - p) * p / keep.numel()) ** 0.5
        assert abs(keep.mean().item() - (1 - p)) < 5 * sigma, f"p={p}: kept {keep.mean().item():.4f}"
        agree = p * p + (1 - p) * (1 - p)  # P(two independent draws agree)
        for name, a, b in (
            ("C", keep[:, :, 1:], keep[:, :, :-1]),
            ("streams", keep[:, 1:], keep[:, :-1]),
            ("tokens", keep[1:], keep[:-1]),
        ):
            got = (a == b).float().mean().item()
            bound = 5 * (agree * (1 - agree) / a.numel()) ** 0.5
            assert abs(got - agree) < bound, (
                f"p={p}: neighbours along {name} agree {got:.4f}, expected {agree:.4f}"
            )


def test_keep_mask_rejects_bad_seed_and_rate():
    """A seed that is not a 0-d int32 tensor, or p outside [0, 1), is a ValueError naming it."""
    with pytest.raises(ValueError, match="seed must be a 0-d int32"):
        keep_mask(torch.tensor(3), (2, 4, 8), 0.1)
    with pytest.raises(ValueError, match="p=1.0"):
        keep_mask(torch.tensor(3, dtype=torch.int32), (2, 4, 8), 1.0)
