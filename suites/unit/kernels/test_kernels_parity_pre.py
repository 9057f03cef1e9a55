"""pre (mapping + Sinkhorn + aggregate in one op): fused backends against `reference`, all gradients."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch, native
from mhc_core.variants import Variant, get_variant
from suites.unit.kernels.parity import Case, backend_params, check_parity, device_for, run_fwd_bwd

FP64, FP32, BF16 = torch.float64, torch.float32, torch.bfloat16
CASES = (
    [Case(tokens=48, n=4, dtype=dt, variant=v) for v in Variant for dt in (FP32, BF16)]
    + [Case(tokens=40, n=2, dtype=FP32, variant=v) for v in (Variant.PAPER, Variant.MEGATRON_DEV)]
    + [Case(tokens=40, n=4, dtype=FP64, variant=Variant.MEGATRON_DEV)]
    + [
        Case(tokens=48, n=4, dtype=dt, variant=get_variant(name), extra="rms1e-3")
        for name, dt in (
            ("megatron_dev+eps_inside_sqrt", FP32),
            ("megatron_main+eps_inside_sqrt+fp32_mappings", BF16),
        )
    ]
)
"""Every variant at n = 4 in fp32 and bf16, n = 2 in fp32, fp64 (dev), and the eps inside the square root (x at
RMS 1e-3, where its placement shows) with fp32 mappings on main."""
GRADS = ["x", "weight", "alpha_pre", "alpha_post", "alpha_res", "bias"]
COSINE = [["alpha_pre", "alpha_post", "alpha_res"], ["bias"], ["weight"], ["x"]]
"""In bf16, grad x too is compared as a vector: the reference rounds mapping's and the aggregate's gradients of x
to bf16 before adding them, the fused pre rounds their sum once; where the two cancel (x at small RMS) the
reference's own rounding is the difference. `test_bf16_pre_is_closer_to_fp64` checks the fused one elementwise."""
ITERATIONS = 4
"""Sinkhorn iterations of the parity cases, as `test_kernels_parity_sinkhorn.py`'s: every step kind of every variant
(start, row and column normalisations, two full rounds) at a fifth of the default's compile time (the iterations
are unrolled into the graphs: a cold compile of one case took 63-92 s at 20, 24-37 s at 4). The default 20 runs in
the conformance matrix's compiled rows (`test_kernels_parity_sinkhorn.py`'s `ITERATIONS` says which) and in the
fused functional run (`suites/functional/test_fused_mhc.py`: megatron_main, n = 4, fp32, the compiled pre under
every native kernel, 20 iterations, losses and grad norms within 1e-5 of the reference run's)."""


def _inputs(case: Case, device: str) -> dict[str, torch.Tensor]:
    """x `[T, n*C]` in the case dtype; fp32 parameters (fp64 in an fp64 case) with gates large enough to matter."""
    gen = torch.Generator().manual_seed(case.tokens * 31 + case.n)
    n, k = case.n, case.n * case.hidden
    big_n = n * n + 2 * n
    params = FP64 if case.dtype == FP64 else FP32

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(shape, generator=gen, dtype=FP64)

    t = {
        "x": (rnd(case.tokens, k) * (1e-3 if case.extra == "rms1e-3" else 1.0)).to(case.dtype),
        "weight": rnd(big_n, k, scale=k**-0.5).to(params),
        "alpha_pre": (0.5 + torch.rand(1, generator=gen, dtype=FP64)).to(params),
        "alpha_post": (0.5 + torch.rand(1, generator=gen, dtype=FP64)).to(params),
        "alpha_res": (0.5 + torch.rand(1, generator=gen, dtype=FP64)).to(params),
        "bias": rnd(big_n, scale=0.3).to(params),
    }
    return {name: v.to(device) for name, v in t.items()}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pre_matches_reference(backend, case):
    """aggregate, h_pre, h_post, h_res and the grads of x, weight, the alphas and bias match the reference."""
    if backend == "cutile" and case.dtype == FP64:
        pytest.skip("the cuTile kernels take bf16 and fp32 (fp64 runs on the next backend under auto)")
    check_parity(
        f"pre[{backend}, {case}]",
        ops.pre,
        dispatch.op_on("pre", backend),
        _inputs(case, device_for(backend)),
        GRADS,
        case.dtype,
        cosine_groups=COSINE,
        n=case.n,
        iterations=ITERATIONS,
        variant=case.variant,
    )


NATIVE_CASES = [
    c
    for c in CASES
    if c.n == 2 or (c.dtype != FP64 and c.variant in (Variant.MEGATRON_MAIN, Variant.MEGATRON_DEV))
]
"""The cases whose passes over x a native kernel takes (fp32 and bf16, the mapping in fp32 or bf16, n = 2 and 4)."""


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize("case", NATIVE_CASES, ids=str)
def test_compiled_pre_matches_reference_under_each_native_kernel(monkeypatch, case, kernel):
    """The compiled pre with `MHC_NATIVE=<kernel>` (each kernel this CPU runs, not only the one `auto` picks, so that
    an AVX-512 box proves the AVX2 path too) matches the reference, forward and every gradient."""
    if not native.built()[0]:
        pytest.skip(native.built()[1])
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    if kernel == native.auto_kernel():
        pytest.skip(
            f"`auto` runs {kernel} on this CPU: test_pre_matches_reference[{case}-compiled] is its run"
        )
    monkeypatch.setenv(native.ENV, kernel)
    check_parity(
        f"pre[compiled, MHC_NATIVE={kernel}, {case}]",
        ops.pre,
        dispatch.op_on("pre", "compiled"),
        _inputs(case, "cpu"),
        GRADS,
        case.dtype,
        cosine_groups=COSINE,
        n=case.n,
        iterations=ITERATIONS,
        variant=case.variant,
    )


@pytest.mark.parametrize("backend", backend_params())
def test_pre_with_unused_outputs(backend):
    """Only the aggregate and h_res feed the loss (h_pre and h_post unused, their gradients None): the
    gradients still match the reference's."""
    case = Case(tokens=48, n=4, dtype=FP32, variant=Variant.MEGATRON_DEV)
    inputs = _inputs(case, device_for(backend))

    def first_and_last(fn):
        def run(**kw):
            agg, _, _, h_res = fn(**kw)
            return agg, h_res

        return run

    check_parity(
        f"pre[{backend}, unused outputs]",
        first_and_last(ops.pre),
        first_and_last(dispatch.op_on("pre", backend)),
        inputs,
        GRADS,
        FP32,
        n=case.n,
        iterations=ITERATIONS,
        variant=case.variant,
    )


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == BF16], ids=str)
def test_bf16_pre_is_closer_to_fp64(backend, case):
    """In bf16, the fused pre's gradient of x (one rounding of the summed gradients) is at least as close to the
    fp64 reference as the bf16 reference's (two roundings, then a bf16 add), at the worst element (within 1e-3 of
    the gradient's scale). The parameters' gradients are token sums, compared as vectors above."""
    device = device_for(backend)
    inputs = _inputs(case, device)
    kw = dict(n=case.n, iterations=ITERATIONS, variant=case.variant)
    _, exact = run_fwd_bwd(ops.pre, {k: v.double() for k, v in inputs.items()}, GRADS, **kw)
    _, ref = run_fwd_bwd(ops.pre, inputs, GRADS, **kw)
    _, got = run_fwd_bwd(dispatch.op_on("pre", backend), inputs, GRADS, **kw)
    for k in ("x",):
        e = exact[k]
        err_ref, err_got = (float((g[k].double() - e).abs().max()) for g in (ref, got))
        scale = float(e.abs().max())
        assert err_got <= err_ref + 1e-3 * scale, (
            f"grad {k}: fused error {err_got:.4g}, reference {err_ref:.4g}, scale {scale:.4g}"
        )


def test_reference_pre_is_the_composition_of_the_ops():
    """The reference pre is mapping, Sinkhorn and aggregate in a row, bit for bit (the module's outputs do not
    move when it calls pre instead of the three ops)."""
    case = Case(tokens=16, n=4, dtype=BF16, variant=Variant.MEGATRON_DEV)
    t = _inputs(case, "cpu")
    w, a_pre, a_post, a_res, b = (t[k] for k in GRADS[1:])
    agg, h_pre, h_post, h_res = ops.pre(
        t["x"], w, a_pre, a_post, a_res, b, n=4, iterations=7, variant=case.variant
    )
    p, q, logits = ops.mapping(t["x"], w, a_pre, a_post, a_res, b, n=4, variant=case.variant)
    assert torch.equal(h_pre, p) and torch.equal(h_post, q)
    assert torch.equal(h_res, ops.sinkhorn(logits, 7, None, case.variant))
    assert torch.equal(agg, ops.h_aggregate(t["x"].view(16, 4, -1), p))


def test_pre_refuses_bad_arguments_naming_them():
    """Bad shapes and iteration counts are the reference's ValueErrors, naming the argument, in every backend."""
    case = Case(tokens=8, n=4, dtype=FP32)
    t = _inputs(case, "cpu")
    w, a_pre, a_post, a_res, b = (t[k] for k in GRADS[1:])
    for fn in (ops.pre, dispatch.op_on("pre", "compiled")):
        with pytest.raises(ValueError, match="pre: iterations"):
            fn(t["x"], w, a_pre, a_post, a_res, b, n=4, iterations=0)
        with pytest.raises(
            ValueError, match=r"pre: weight must have shape \[N, n\*C\] = \[24, 256\], got \[24, 8\]"
        ):
            fn(t["x"], w[:, :8], a_pre, a_post, a_res, b, n=4)
