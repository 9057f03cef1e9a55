"""The native (C) forward and backward passes of the fused pre-op: each of its kernels (AVX-512 with BF16 dot
products, AVX-512, AVX2, portable; one this CPU lacks is skipped, naming it) against the reference or fp64 math,
at sizes that leave tails (C not a multiple of the lanes, T not a multiple of the token block), on several
threads, `MHC_NATIVE`'s choices, and the compiled `pre` with it turned off. The compiled `pre` with the native
kernel in it, forward and backward, is `test_kernels_parity_pre.py`'s."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch, native
from mhc_core.testing import assert_close, tolerance
from mhc_core.variants import get_variant
from suites.unit.kernels.parity import Case, check_parity

pytestmark = pytest.mark.skipif(not native.built()[0], reason=native.built()[1])

PARAMS = ["weight", "alpha_pre", "alpha_post", "alpha_res", "bias"]


def _fastest() -> str:
    """The fastest kernel this CPU runs (`portable` on a host without AVX2, where `auto` picks none)."""
    return native.kernels()[0]


def _inputs(t: int, n: int, c: int, dtype: torch.dtype, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big_n, k = n * n + 2 * n, n * c
    return {
        "x": torch.randn(t, k, generator=g).to(dtype),
        "weight": torch.randn(big_n, k, generator=g) * k**-0.5,
        "alpha_pre": torch.tensor([0.8]),
        "alpha_post": torch.tensor([1.1]),
        "alpha_res": torch.tensor([0.6]),
        "bias": torch.randn(big_n, generator=g) * 0.3,
    }


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize(
    ("t", "n", "c", "dtype", "variant"),
    [
        (13, 4, 37, torch.float32, "megatron_dev"),
        (10, 2, 64, torch.bfloat16, "megatron_dev"),
        (7, 4, 24, torch.float32, "megatron_main+eps_inside_sqrt"),
        (5, 8, 16, torch.bfloat16, "paper"),
        (
            9,
            4,
            200,
            torch.float32,
            "megatron_dev",
        ),  # K = 800: one full 512-wide chunk, a partial one, a tail of lanes
        (6, 8, 70, torch.bfloat16, "megatron_dev"),  # N = 80: 13 full column groups of 6 and 2 left over
        (10, 4, 64, torch.bfloat16, "megatron_main"),  # the mapping in bf16: the projection rounded to bf16
        (7, 2, 40, torch.bfloat16, "megatron_main+eps_inside_sqrt"),
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_native_forward_matches_the_reference(t, n, c, dtype, variant, kernel):
    """h_pre and the aggregate of every kernel match the reference pre within the activation dtype's forward bound
    (h_pre in the coefficients' dtype, the aggregate in x's), and the projection and RMS the reference mapping's."""
    spec = get_variant(variant)
    d = _inputs(t, n, c, dtype)
    agg, h_pre, _, _ = ops.pre(
        d["x"],
        d["weight"],
        d["alpha_pre"],
        d["alpha_post"],
        d["alpha_res"],
        d["bias"],
        n=n,
        iterations=20,
        variant=spec,
    )
    compute = torch.float32 if spec.mapping_fp32 else dtype
    out_dtype = dtype if spec.coefficients_in_activation_dtype else compute
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    proj, rms, got_h, got_agg = native.pre_forward(
        d["x"],
        d["weight"],
        d["alpha_pre"],
        d["bias"],
        n,
        1e-6,
        spec.norm_eps_inside,
        spec.h_pre_eps,
        out_dtype,
        compute,
        kernel=kernel,
    )
    tol = tolerance(dtype, "fwd")
    assert (got_h.dtype, got_agg.dtype, proj.dtype) == (h_pre.dtype, agg.dtype, compute)
    assert_close("h_pre", got_h, h_pre, tol)
    assert_close("aggregate", got_agg, agg, tol)
    x64 = d["x"].double()
    assert_close("proj", proj.double(), x64 @ d["weight"].to(compute).double().t(), tolerance(compute, "fwd"))
    sq = (x64 * x64).mean(-1, keepdim=True)
    want_rms = (sq + 1e-6).sqrt() if spec.norm_eps_inside else sq.sqrt()
    assert_close("rms", rms.double(), want_rms, tolerance(torch.float32, "fwd"))


def test_native_refuses_what_it_has_no_kernel_for():
    """fp64 activations and more than 8 streams are refused naming the input (the compiled pre never sends them)."""
    d = _inputs(4, 4, 8, torch.float64)
    with pytest.raises(
        ValueError, match=r"x must be a 2-d CPU fp32 / bf16 tensor, got torch.float64 \(4, 32\)"
    ):
        native.pre_forward(
            d["x"],
            d["weight"],
            d["alpha_pre"],
            d["bias"],
            4,
            1e-6,
            False,
            0.0,
            torch.float32,
            kernel=_fastest(),
        )
    d = _inputs(2, 9, 4, torch.float32)
    with pytest.raises(ValueError, match=r"n=9 must be in \[1, 8\]"):
        native.pre_forward(
            d["x"],
            d["weight"],
            d["alpha_pre"],
            d["bias"],
            9,
            1e-6,
            False,
            0.0,
            torch.float32,
            kernel=_fastest(),
        )


def _grad_inputs(t: int, n: int, c: int, dtype: torch.dtype, seed: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big_n = n * n + 2 * n
    return {
        "x": torch.randn(t, n * c, generator=g).to(dtype),
        "g_agg": torch.randn(t, c, generator=g).to(dtype),
        "weight": torch.randn(big_n, n * c, generator=g),
        "g_proj": torch.randn(t, big_n, generator=g),
        "coef": torch.randn(t, 1, generator=g),
        "h_pre": torch.rand(t, n, generator=g),
    }


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize(
    ("t", "n", "c", "dtype"),
    [
        (37, 4, 70, torch.float32),  # C not a multiple of either lane count, T not of either token block
        (50, 2, 64, torch.bfloat16),
        (24, 8, 16, torch.bfloat16),
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_native_backward_passes_match_fp64(t, n, c, dtype, kernel):
    """The backward's passes of every kernel against fp64 math on the same (rounded) inputs: the aggregate's
    gradient of h_pre and the gradient of W at fp32's bound, the gradient of x at its dtype's (it is rounded once),
    on 1 and 3 threads; without `need_x` / `need_w` the other is the same and the skipped one None."""
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    d = _grad_inputs(t, n, c, dtype)
    f = {name: v.double() for name, v in d.items()}
    want_h = (f["g_agg"][:, None, :] * f["x"].view(t, n, c)).sum(-1)
    want_x = (
        f["g_proj"] @ f["weight"]
        + f["coef"] * f["x"]
        + (f["h_pre"][:, :, None] * f["g_agg"][:, None, :]).reshape(t, n * c)
    )
    want_w = f["g_proj"].t() @ f["x"]
    args = (d["x"], d["g_agg"], d["weight"], d["g_proj"], d["coef"], d["h_pre"], n)
    for threads in (1, 3):
        assert_close(
            "g_h",
            native.grad_h(d["x"], d["g_agg"], n, kernel=kernel, threads=threads).double(),
            want_h,
            tolerance(torch.float32, "fwd"),
        )
        g_x, g_w = native.grad_x_w(*args, True, True, kernel=kernel, threads=threads)
        assert g_x.dtype == dtype and g_w.dtype == torch.float32
        assert_close("g_x", g_x.double(), want_x, tolerance(dtype, "fwd"))
        assert_close("g_w", g_w.double(), want_w, tolerance(torch.float32, "fwd"))
    only_x, none_w = native.grad_x_w(*args, True, False, kernel=kernel, threads=3)
    none_x, only_w = native.grad_x_w(*args, False, True, kernel=kernel, threads=3)
    assert none_w is None and none_x is None and torch.equal(only_x, g_x) and torch.equal(only_w, g_w)


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize(
    ("t", "n", "c"), [(37, 4, 70), (50, 2, 64), (13, 1, 48), (31, 8, 16)], ids=lambda v: str(v)
)
def test_native_backward_with_bf16_products_matches_fp64(t, n, c, kernel):
    """With a mapping computed in bf16 (`bf16_products`: W and g_proj rounded to bf16, the avx512_bf16 kernel's
    dot products of bf16 pairs) every kernel's g_x and g_W match fp64 math on the rounded inputs, on 1 and 4
    threads, at sizes with tails (T not a multiple of the 6-token block, C of the 16 lanes, N = 3 odd at n = 1)."""
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    d = _grad_inputs(t, n, c, torch.bfloat16, seed=3)
    f = {name: v.double() for name, v in d.items()}
    for name in ("weight", "g_proj"):
        f[name] = d[name].to(torch.bfloat16).double()
    want_x = (
        f["g_proj"] @ f["weight"]
        + f["coef"] * f["x"]
        + (f["h_pre"][:, :, None] * f["g_agg"][:, None, :]).reshape(t, n * c)
    )
    want_w = f["g_proj"].t() @ f["x"]
    for threads in (1, 4):
        g_x, g_w = native.grad_x_w(
            d["x"],
            d["g_agg"],
            d["weight"],
            d["g_proj"],
            d["coef"],
            d["h_pre"],
            n,
            True,
            True,
            kernel=kernel,
            threads=threads,
            bf16_products=True,
        )
        assert_close("g_x", g_x.double(), want_x, tolerance(torch.bfloat16, "fwd"))
        assert_close("g_w", g_w.double(), want_w, tolerance(torch.float32, "fwd"))
        only_w = native.grad_x_w(
            d["x"],
            d["g_agg"],
            d["weight"],
            d["g_proj"],
            d["coef"],
            d["h_pre"],
            n,
            False,
            True,
            kernel=kernel,
            threads=threads,
            bf16_products=True,
        )[1]
        assert torch.equal(only_w, g_w)


def test_native_backward_bits_by_thread_count():
    """g_x does not depend on the thread count; g_W, each slice's tokens then the slices summed in order, gives
    the same bits for the same count."""
    d = _grad_inputs(101, 4, 40, torch.bfloat16, seed=2)
    args = (d["x"], d["g_agg"], d["weight"], d["g_proj"], d["coef"], d["h_pre"], 4, True, True)
    for bf16_products in (False, True):
        kw = {"kernel": _fastest(), "bf16_products": bf16_products}
        g_x1, _ = native.grad_x_w(*args, threads=1, **kw)
        g_x4, g_w4 = native.grad_x_w(*args, threads=4, **kw)
        again_x4, again_w4 = native.grad_x_w(*args, threads=4, **kw)
        assert torch.equal(g_x1, g_x4) and torch.equal(g_x4, again_x4) and torch.equal(g_w4, again_w4), (
            bf16_products
        )
    with pytest.raises(ValueError, match=r"native grad_x_w: g_proj \(101, 23\) must be \[101, 24\]"):
        native.grad_x_w(
            d["x"],
            d["g_agg"],
            d["weight"],
            d["g_proj"][:, :23],
            d["coef"],
            d["h_pre"],
            4,
            True,
            True,
            kernel=_fastest(),
        )
    with pytest.raises(ValueError, match=r"native grad_h: g_agg \(101, 39\) must be \[T, C\] = \[101, 40\]"):
        native.grad_h(d["x"], d["g_agg"][:, :39], 4, kernel=_fastest())


@pytest.mark.parametrize("kernel", native.KERNELS)
def test_the_bf16_aggregate_rounds_to_nearest_even_as_torch(kernel):
    """With W = 0 and bias 100, h_pre is exactly 1 (sigmoid in fp32), so the aggregate of two streams is the exact
    fp32 sum x0 + x1 rounded once to bf16: every kernel's rounding (the SIMD ones in vector lanes) gives torch's
    bits, ties to even (x1 = x0 * 2^-8 and 2^-9 put sums on and beside ties) and overflow to inf included."""
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    g = torch.Generator().manual_seed(11)
    t, c = 6, 64 + 5  # the vector lanes and a scalar tail
    x0 = torch.randn(t, c, generator=g).to(torch.bfloat16)
    x1 = torch.randn(t, c, generator=g).to(torch.bfloat16)
    x1[0:2] = x0[0:2] * 2.0**-8  # a tie wherever x0's last mantissa bit is set
    x1[2:4] = x0[2:4] * 2.0**-9
    x0[4, :8], x1[4, :8] = 3.0e38, 3.0e38  # their fp32 sum overflows to inf
    x = torch.cat([x0, x1], dim=1)
    w = torch.zeros(8, 2 * c)
    _, _, h_pre, agg = native.pre_forward(
        x, w, torch.tensor([1.0]), torch.full((8,), 100.0), 2, 1e-6, False, 0.0, torch.float32, kernel=kernel
    )
    assert torch.equal(h_pre, torch.ones(t, 2))
    want = (x0.float() + x1.float()).to(torch.bfloat16)
    assert torch.isinf(want[4, :8]).all()
    mismatch = (agg.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, (
        f"{kernel}: {len(mismatch)} lanes differ from torch's rounding, first at {mismatch[0].tolist()}"
    )


def test_the_kernels_run_in_the_order_of_their_speed_and_are_deterministic(monkeypatch):
    """Every CPU runs `portable`; an x86 one with AVX2 also `avx2`, ahead of it; `auto` (MHC_NATIVE unset) takes
    the first. Each kernel gives the same bits twice; two kernels sum in another order (they may differ)."""
    monkeypatch.delenv(
        native.ENV, raising=False
    )  # a caller's MHC_NATIVE would pick another kernel than auto's
    here = native.kernels()
    assert here[-1] == "portable" and list(here) == [k for k in native.KERNELS if k in here], here
    d = _inputs(11, 4, 96, torch.float32, seed=3)
    args = (d["x"], d["weight"], d["alpha_pre"], d["bias"], 4, 1e-6, False, 0.0, torch.float32)
    for kernel in here:
        first, second = native.pre_forward(*args, kernel=kernel), native.pre_forward(*args, kernel=kernel)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), kernel
    if here[0] != "portable":
        assert all(
            torch.equal(a, b)
            for a, b in zip(native.pre_forward(*args), native.pre_forward(*args, kernel=here[0]), strict=True)
        )


def test_avx512_bf16_is_avx512_but_for_the_bf16_mapping():
    """`avx512_bf16` runs `avx512`'s code (the same bits) wherever the mapping computes in fp32; where it computes in
    bf16 on bf16 x, its forward sums the projection and the squares, and its backward g_W, from bf16 pairs: another
    order (the RMS's and g_W's bits differ), within the bounds of the reference and fp64 (the tests above)."""
    if "avx512_bf16" not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the avx512_bf16 kernel (it runs {native.kernels()})")
    d = _inputs(30, 4, 256, torch.bfloat16, seed=6)
    args = (d["x"], d["weight"], d["alpha_pre"], d["bias"], 4, 1e-6, False, 1e-6, torch.float32)
    same = native.pre_forward(*args, torch.float32, kernel="avx512_bf16")
    assert all(
        torch.equal(a, b)
        for a, b in zip(same, native.pre_forward(*args, torch.float32, kernel="avx512"), strict=True)
    )
    dot = native.pre_forward(*args, torch.bfloat16, kernel="avx512_bf16")
    fma = native.pre_forward(*args, torch.bfloat16, kernel="avx512")
    assert not torch.equal(dot[1], fma[1]), "the bf16-mapping forward of avx512_bf16 ran avx512's fp32 FMAs"
    assert_close("rms", dot[1], fma[1], tolerance(torch.float32, "fwd"))
    g = _grad_inputs(30, 4, 64, torch.bfloat16)
    for bf16_products in (False, True):
        (gx_dot, gw_dot), (gx_fma, gw_fma) = [
            native.grad_x_w(
                g["x"],
                g["g_agg"],
                g["weight"],
                g["g_proj"],
                g["coef"],
                g["h_pre"],
                4,
                True,
                True,
                kernel=k,
                bf16_products=bf16_products,
            )
            for k in ("avx512_bf16", "avx512")
        ]
        assert torch.equal(gx_dot, gx_fma) or bf16_products
        assert torch.equal(gw_dot, gw_fma) != bf16_products, (
            "g_W of the bf16 pairs' pass is avx512's fp32 FMAs'"
        )


def test_auto_never_picks_the_scalar_kernel(monkeypatch):
    """On a CPU with no SIMD kernel (no AVX2: an ARM host, say) `auto` leaves the forward to the compiled graph,
    ~25x faster than the scalar kernel, and says why; `MHC_NATIVE=portable` still forces it."""
    monkeypatch.setattr(native, "kernels", lambda: ("portable",))
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.chosen_kernel() is None
    assert native.available() == (
        False,
        "no SIMD kernel for this CPU (AVX2 or AVX-512; MHC_NATIVE=portable forces the scalar one)",
    )
    monkeypatch.setenv(native.ENV, "portable")
    assert native.chosen_kernel() == "portable" and native.available()[0]


def test_the_thread_count_changes_no_bit():
    """The tokens split over 1, 2 or 5 threads (slices of whole blocks, a short last one) give the same bits: every
    token's results depend on its own row alone."""
    d = _inputs(197, 4, 40, torch.bfloat16, seed=4)
    args = (d["x"], d["weight"], d["alpha_pre"], d["bias"], 4, 1e-6, True, 1e-6, torch.bfloat16)
    for kernel in native.kernels():
        for compute in (torch.float32, torch.bfloat16):
            one = native.pre_forward(*args, compute, kernel=kernel, threads=1)
            for threads in (2, 5):
                many = native.pre_forward(*args, compute, kernel=kernel, threads=threads)
                assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True)), (
                    kernel,
                    compute,
                    threads,
                )
    with pytest.raises(ValueError, match=r"threads=0 must be in \[1, 256\]"):
        native.pre_forward(*args, kernel=_fastest(), threads=0)


def test_mhc_native_names_a_kernel_or_is_refused(monkeypatch):
    """`MHC_NATIVE=<kernel>` picks it; a value that is no kernel, or a kernel this CPU lacks, is refused naming
    the value and what the CPU runs (never a silent fallback to another kernel)."""
    monkeypatch.setenv(native.ENV, "portable")
    assert (True, "native pre-op kernels (portable)") == native.available()
    monkeypatch.setenv(native.ENV, "avx1024")
    with pytest.raises(
        ValueError, match=r"MHC_NATIVE='avx1024' is none of 0, 1, auto, avx512_bf16, avx512, avx2, portable"
    ):
        native.available()
    missing = [k for k in native.KERNELS if k not in native.kernels()]
    if missing:
        monkeypatch.setenv(native.ENV, missing[0])
        with pytest.raises(
            ValueError, match=f"MHC_NATIVE='{missing[0]}': this CPU lacks that kernel's instructions"
        ):
            native.available()
    d = _inputs(2, 4, 8, torch.float32)
    with pytest.raises(
        ValueError, match=r"kernel='sse' is none of 'auto', 'portable', 'avx2', 'avx512', 'avx512_bf16'"
    ):
        native.pre_forward(
            d["x"], d["weight"], d["alpha_pre"], d["bias"], 4, 1e-6, False, 0.0, torch.float32, kernel="sse"
        )


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize(
    ("dtype", "variant", "native_bwd"),
    [
        (torch.float32, "megatron_main", True),
        (torch.bfloat16, "megatron_dev", True),  # fp32 mappings on bf16 activations
        (
            torch.bfloat16,
            "megatron_main",
            False,
        ),  # the mapping in bf16: the compiled graph's bf16 GEMMs, but for ...
    ],
    ids=["fp32-main", "bf16-dev", "bf16-main"],
)
def test_compiled_pre_calls_the_native_passes(monkeypatch, dtype, variant, native_bwd, kernel):
    """The compiled `pre` on CPU runs the native forward under every kernel this CPU runs, and its backward's two
    native passes exactly where the mapping computes in fp32, or in bf16 under `avx512_bf16` (... its bf16 dot
    products; counted, so that a dispatch that quietly kept the compiled graph, or another kernel, fails here)."""
    native_bwd = native_bwd or kernel == "avx512_bf16"
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    monkeypatch.setenv(native.ENV, kernel)
    calls = {"pre_forward": 0, "grad_h": 0, "grad_x_w": 0}
    ran = set()
    for name in calls:
        real = getattr(native, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            ran.add(kwargs.get("kernel") or native.chosen_kernel())
            return _real(*args, **kwargs)

        monkeypatch.setattr(native, name, counted)
    d = _inputs(30, 4, 32, dtype, seed=6)
    leaves = {k: v.requires_grad_() for k, v in d.items()}
    outs = dispatch.op_on("pre", "compiled")(*leaves.values(), 4, 4, variant)
    torch.autograd.backward(outs[:1], [torch.ones_like(outs[0])])
    assert calls == {"pre_forward": 1, "grad_h": int(native_bwd), "grad_x_w": int(native_bwd)}, calls
    assert ran == {kernel}, ran
    assert all(v.grad is not None and torch.isfinite(v.grad).all() for v in leaves.values())


def test_compiled_pre_without_the_native_forward(monkeypatch):
    """With `MHC_NATIVE=0` the compiled pre runs its torch.compile forward, and still matches the reference."""
    monkeypatch.setenv(native.ENV, "0")
    assert not native.available()[0] and "MHC_NATIVE=0" in native.available()[1]
    case = Case(tokens=24, n=4, dtype=torch.float32, variant=get_variant("megatron_dev"))
    d = _inputs(case.tokens, case.n, 16, case.dtype, seed=9)
    check_parity(
        "pre[compiled, MHC_NATIVE=0]",
        ops.pre,
        dispatch.op_on("pre", "compiled"),
        d,
        ["x", *PARAMS],
        case.dtype,
        n=case.n,
        iterations=4,
        variant=case.variant,
    )
