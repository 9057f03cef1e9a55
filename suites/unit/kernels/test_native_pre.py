"""The native (C) forward of the fused pre-op: its AVX2 and portable kernels against the reference, at sizes
that leave tails (C not a multiple of 8 lanes, T not a multiple of the token block), and the compiled `pre`
with it turned off (`MHC_NATIVE=0`)."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch, native
from mhc_core.testing import assert_close, tolerance
from mhc_core.variants import get_variant
from suites.unit.kernels.parity import Case, check_parity

pytestmark = pytest.mark.skipif(not native.available()[0], reason=native.available()[1])

PARAMS = ["weight", "alpha_pre", "alpha_post", "alpha_res", "bias"]


def _inputs(t: int, n: int, c: int, dtype: torch.dtype, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big_n, k = n * n + 2 * n, n * c
    return {"x": torch.randn(t, k, generator=g).to(dtype), "weight": torch.randn(big_n, k, generator=g) * k**-0.5,
            "alpha_pre": torch.tensor([0.8]), "alpha_post": torch.tensor([1.1]), "alpha_res": torch.tensor([0.6]),
            "bias": torch.randn(big_n, generator=g) * 0.3}


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize(("t", "n", "c", "dtype", "variant"), [
    (13, 4, 37, torch.float32, "megatron_dev"),
    (10, 2, 64, torch.bfloat16, "megatron_dev"),
    (7, 4, 24, torch.float32, "megatron_main+eps_inside_sqrt"),
    (5, 8, 16, torch.bfloat16, "paper"),
], ids=lambda v: str(v).removeprefix("torch."))
def test_native_forward_matches_the_reference(t, n, c, dtype, variant, portable):
    """h_pre and the aggregate of both kernels match the reference pre within the activation dtype's forward bound
    (h_pre in the coefficients' dtype, the aggregate in x's), and the projection and RMS the reference mapping's."""
    spec = get_variant(variant)
    d = _inputs(t, n, c, dtype)
    agg, h_pre, _, _ = ops.pre(*d.values(), n, 20, spec)
    out_dtype = dtype if spec.coefficients_in_activation_dtype else torch.float32
    proj, rms, got_h, got_agg = native.pre_forward(d["x"], d["weight"], d["alpha_pre"], d["bias"], n, 1e-6,
                                                   spec.norm_eps_inside, spec.h_pre_eps, out_dtype, portable=portable)
    tol = tolerance(dtype, "fwd")
    assert got_h.dtype == h_pre.dtype and got_agg.dtype == agg.dtype
    assert_close("h_pre", got_h, h_pre, tol)
    assert_close("aggregate", got_agg, agg, tol)
    x64 = d["x"].double()
    assert_close("proj", proj.double(), x64 @ d["weight"].double().t(), tolerance(torch.float32, "fwd"))
    sq = (x64 * x64).mean(-1, keepdim=True)
    want_rms = (sq + 1e-6).sqrt() if spec.norm_eps_inside else sq.sqrt()
    assert_close("rms", rms.double(), want_rms, tolerance(torch.float32, "fwd"))


def test_native_refuses_what_it_has_no_kernel_for():
    """fp64 activations and more than 8 streams are refused naming the input (the compiled pre never sends them)."""
    d = _inputs(4, 4, 8, torch.float64)
    with pytest.raises(ValueError, match="x must be a CPU fp32 / bf16 tensor, got torch.float64"):
        native.pre_forward(d["x"], d["weight"], d["alpha_pre"], d["bias"], 4, 1e-6, False, 0.0, torch.float32)
    d = _inputs(2, 9, 4, torch.float32)
    with pytest.raises(ValueError, match=r"n=9 must be in \[1, 8\]"):
        native.pre_forward(d["x"], d["weight"], d["alpha_pre"], d["bias"], 9, 1e-6, False, 0.0, torch.float32)


def test_compiled_pre_without_the_native_forward(monkeypatch):
    """With `MHC_NATIVE=0` the compiled pre runs its torch.compile forward, and still matches the reference."""
    monkeypatch.setenv(native.ENV, "0")
    assert not native.available()[0] and "MHC_NATIVE=0" in native.available()[1]
    case = Case(tokens=24, n=4, dtype=torch.float32, variant=get_variant("megatron_dev"))
    d = _inputs(case.tokens, case.n, 16, case.dtype, seed=9)
    check_parity("pre[compiled, MHC_NATIVE=0]", ops.pre, dispatch.get_impl("pre", "compiled"), d, ["x", *PARAMS],
                 case.dtype, n=case.n, iterations=20, variant=case.variant)
