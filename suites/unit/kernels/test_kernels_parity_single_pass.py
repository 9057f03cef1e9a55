"""The single-pass pre-op (DeepSeek-V4.1: the aggregate with the previous sublayer's H_pre): fused backends against
`reference`, forward and every gradient, the previous H_pre's included."""

from __future__ import annotations

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch, native
from mhc_core.variants import get_variant
from suites.unit.kernels.parity import Case, backend_params, check_parity, device_for
from suites.unit.kernels.test_kernels_parity_pre import COSINE, GRADS, ITERATIONS
from suites.unit.kernels.test_kernels_parity_pre import _inputs as pre_inputs

FP32, BF16 = torch.float32, torch.bfloat16
V41 = get_variant("deepseek_v41")
CASES = [
    Case(tokens=48, n=4, dtype=FP32, variant=V41),
    Case(tokens=48, n=4, dtype=BF16, variant=V41),
    Case(tokens=48, n=4, dtype=FP32, variant=V41, extra="entry"),
    Case(tokens=48, n=4, dtype=BF16, variant=get_variant("megatron_main")),
]
"""DeepSeek-V4.1's numerics in fp32 and bf16, its model entry (no previous H_pre: stream 0), and main's activation-
dtype coefficients in bf16 (a bf16 mix)."""
SP_GRADS = [*GRADS, "previous_h_pre"]
SP_COSINE = [*COSINE, ["previous_h_pre"]]


def _inputs(case: Case, device: str) -> dict[str, torch.Tensor | None]:
    """`pre`'s inputs and the previous sublayer's H_pre `[T, n]` (in the dtype a sublayer hands on, `mix_dtype`;
    None in an `entry` case)."""
    t: dict[str, torch.Tensor | None] = dict(pre_inputs(case, device))
    gen = torch.Generator().manual_seed(case.tokens * 7 + case.n)
    mix = 0.2 + torch.rand(case.tokens, case.n, generator=gen, dtype=torch.float64)
    dtype = ops.mix_dtype(case.variant, case.dtype)
    t["previous_h_pre"] = None if case.extra == "entry" else mix.to(dtype).to(device)
    return t


def _on(backend: str):
    return dispatch.op_on("single_pass_pre", backend)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_single_pass_pre_matches_reference(backend, case):
    """aggregate (with the previous H_pre), next H_pre, h_post, h_res and the gradients of x, the parameters and the
    previous H_pre match the reference."""
    check_parity(
        f"single_pass_pre[{backend}, {case}]",
        ops.single_pass_pre,
        _on(backend),
        _inputs(case, device_for(backend)),
        SP_GRADS,
        case.dtype,
        cosine_groups=SP_COSINE,
        n=case.n,
        iterations=ITERATIONS,
        variant=case.variant,
    )


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_single_pass_pre_under_each_native_kernel(monkeypatch, case, kernel):
    """The compiled single-pass pre with `MHC_NATIVE=<kernel>` (each kernel this CPU runs, so that an AVX-512 box
    proves the AVX2 path too) matches the reference, forward and every gradient."""
    if not native.built()[0]:
        pytest.skip(native.built()[1])
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    if kernel == native.auto_kernel():
        pytest.skip(f"`auto` runs {kernel} on this CPU: test_single_pass_pre_matches_reference is its run")
    monkeypatch.setenv(native.ENV, kernel)
    check_parity(
        f"single_pass_pre[compiled, MHC_NATIVE={kernel}, {case}]",
        ops.single_pass_pre,
        _on("compiled"),
        _inputs(case, "cpu"),
        SP_GRADS,
        case.dtype,
        cosine_groups=SP_COSINE,
        n=case.n,
        iterations=ITERATIONS,
        variant=case.variant,
    )


def test_native_forward_weights_the_streams_with_the_mix():
    """The native forward given a mix returns the aggregate with it, and the same projection, RMS and H_pre as
    without (the H_pre is the next sublayer's, not the one that weighted the streams)."""
    if native.chosen_kernel() is None:
        pytest.skip(f"no native kernel runs here: {native.available()[1]}")
    case = CASES[0]
    t = _inputs(case, "cpu")
    x, w, a_pre, b, mix = (t[k] for k in ("x", "weight", "alpha_pre", "bias", "previous_h_pre"))
    args = (x, w, a_pre, b, 4, 1e-6, True, 1e-6, FP32)
    own = native.pre_forward(*args)
    given = native.pre_forward(*args, mix=mix)
    for name, a, e in zip(("proj", "rms", "h_pre"), given[:3], own[:3], strict=True):
        assert torch.equal(a, e), f"{name} moved when the mix was given"
    want = ops.h_aggregate(x.view(48, 4, -1), mix)
    assert float((given[3] - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert not torch.equal(given[3], own[3])
    with pytest.raises(ValueError, match=r"mix must be \[T, n\] = \[48, 4\]"):
        native.pre_forward(*args, mix=mix[:, :2])


def test_entry_aggregate_is_stream_zero_exactly():
    """At the model's entry the compiled single-pass pre's aggregate is stream 0 bit for bit, and its gradient of x
    is zero on every other stream."""
    case = CASES[2]
    t = _inputs(case, "cpu")
    x = t["x"].clone().requires_grad_()
    w, a_pre, a_post, a_res, b = (t[k] for k in GRADS[1:])
    params = (w, a_pre, a_post, a_res, b)
    agg, *_ = _on("compiled")(x, None, *params, n=4, iterations=ITERATIONS, variant=case.variant)
    assert torch.equal(agg, x.view(48, 4, -1)[:, 0].detach())
    agg.sum().backward()
    assert torch.count_nonzero(x.grad.view(48, 4, -1)[:, 0] - 1) < 48 * 64  # the mapping's share is there too
    ref = x.detach().clone().requires_grad_()
    ops.single_pass_pre(ref, None, w, a_pre, a_post, a_res, b, 4, ITERATIONS, case.variant)[
        0
    ].sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)
