"""Determinism verdicts per backend and kernel: run to run, batch invariance, 1 vs 2 threads.

Each op on `reference` and `compiled` (forward and every gradient; the single-pass pre among them), and each native
kernel of the fused pre-op
this CPU runs, each forced (its forward and both backward passes), is probed by
`harness.conformance.determinism.probe`; the verdicts print as a table at the end of the session
(`docs/kernels.md`, "Determinism", says why a probe varies). What the design promises is asserted: every subject
is bitwise run to run on CPU, and the native kernels are batch and thread-count invariant (a token's rows are
computed by one thread in a fixed order; the weight gradient's token sum is reduced in a fixed order).
"""

from __future__ import annotations

import pytest
import torch

from harness.conformance.determinism import Subject, Verdict, probe
from mhc_core.kernels import dispatch, native
from mhc_core.testing import tolerance
from suites.unit.kernels.parity import C
from suites.unit.kernels.test_kernels_parity_pre import ITERATIONS

T, N_STREAMS, VARIANT = 48, 4, "megatron_dev"
"""The parity tests' shapes (the compiled graphs are shared; the token dim is dynamic), at their Sinkhorn iterations
(`ITERATIONS`, 4: the compiled graph unrolls them, and the order of every reduction, which is what the probes see, is
the same in each iteration)."""


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _op_subjects(backend: str) -> list[Subject]:
    n, k = N_STREAMS, N_STREAMS * C
    big_n = n * n + 2 * n
    g = _g(11)
    alphas = {
        "alpha_pre": torch.tensor([0.8]),
        "alpha_post": torch.tensor([1.1]),
        "alpha_res": torch.tensor([0.6]),
    }
    params = {
        "weight": torch.randn(big_n, k, generator=g) * k**-0.5,
        **alphas,
        "bias": torch.randn(big_n, generator=g) * 0.3,
    }
    return [
        Subject(
            name=f"pre[{backend}]",
            fn=dispatch.op_on("pre", backend),
            inputs={"x": torch.randn(T, k, generator=g), **params},
            grad_names=("x", *params),
            kwargs={"n": n, "iterations": ITERATIONS, "variant": VARIANT},
        ),
        Subject(
            name=f"single_pass_pre[{backend}]",
            fn=dispatch.op_on("single_pass_pre", backend),
            inputs={
                "x": torch.randn(T, k, generator=g),
                "previous_h_pre": 0.2 + torch.rand(T, n, generator=g),
                **params,
            },
            grad_names=("x", "previous_h_pre", *params),
            token_inputs=("x", "previous_h_pre"),
            kwargs={"n": n, "iterations": ITERATIONS, "variant": "deepseek_v41"},
        ),
        Subject(
            name=f"h_post_bda[{backend}]",
            fn=dispatch.op_on("h_post_bda", backend),
            inputs={
                "h_res": torch.rand(T, n, n, generator=g),
                "residual": torch.randn(T, n, C, generator=g),
                "h_post": torch.rand(T, n, generator=g) * 2,
                "y": torch.randn(T, C, generator=g),
                "bias": torch.randn(C, generator=g),
            },
            grad_names=("h_res", "residual", "h_post", "y", "bias"),
            token_inputs=("h_res", "residual", "h_post", "y"),
            kwargs={"variant": VARIANT},
        ),
        Subject(
            name=f"h_aggregate[{backend}]",
            fn=dispatch.op_on("h_aggregate", backend),
            inputs={"x": torch.randn(T, n, C, generator=g), "h_pre": torch.rand(T, n, generator=g)},
            grad_names=("x", "h_pre"),
            token_inputs=("x", "h_pre"),
        ),
        Subject(
            name=f"sinkhorn[{backend}]",
            fn=dispatch.op_on("sinkhorn", backend),
            inputs={"logits": torch.randn(T, n, n, generator=g)},
            grad_names=("logits",),
            token_inputs=("logits",),
            kwargs={"iterations": ITERATIONS, "variant": VARIANT},
        ),
    ]


def _native_subjects(kernel: str) -> list[Subject]:
    """The three passes of the native pre-op on `kernel`, at sizes with tails (T not a multiple of the token
    block, C not of the lanes)."""
    t, n, c = 37, 4, 70
    k, big_n = n * c, n * n + 2 * n
    g = _g(13)
    x = torch.randn(t, k, generator=g)
    weight = torch.randn(big_n, k, generator=g) * k**-0.5
    fixed = {"kernel": kernel}
    grad_inputs = {
        "x": x,
        "g_agg": torch.randn(t, c, generator=g),
        "g_proj": torch.randn(t, big_n, generator=g),
        "coef": torch.randn(t, 1, generator=g),
        "h_pre": torch.rand(t, n, generator=g),
    }
    return [
        Subject(
            name=f"pre_forward[native:{kernel}]",
            fn=lambda x, weight, bias, **kw: native.pre_forward(
                x, weight, torch.tensor([0.8]), bias, n, 1e-6, False, 1e-6, torch.float32, **kw
            ),
            inputs={"x": x, "weight": weight, "bias": torch.randn(big_n, generator=g)},
            kwargs=fixed,
            threads_kwarg="threads",
        ),
        Subject(
            name=f"pre_forward_single_pass[native:{kernel}]",
            fn=lambda x, mix, weight, bias, **kw: native.pre_forward(
                x, weight, torch.tensor([0.8]), bias, n, 1e-6, True, 1e-6, torch.float32, mix=mix, **kw
            ),
            inputs={
                "x": x,
                "mix": 0.2 + torch.rand(t, n, generator=g),
                "weight": weight,
                "bias": torch.randn(big_n, generator=g),
            },
            token_inputs=("x", "mix"),
            kwargs=fixed,
            threads_kwarg="threads",
        ),
        Subject(
            name=f"grad_h[native:{kernel}]",
            fn=lambda x, g_agg, **kw: native.grad_h(x, g_agg, n, **kw),
            inputs={"x": x, "g_agg": torch.randn(t, c, generator=g)},
            token_inputs=("x", "g_agg"),
            kwargs=fixed,
            threads_kwarg="threads",
        ),
        Subject(
            name=f"grad_x[native:{kernel}]",
            fn=lambda x, g_agg, g_proj, coef, h_pre, **kw: native.grad_x_w(
                x, g_agg, weight, g_proj, coef, h_pre, n, True, False, **kw
            )[0],
            inputs=dict(grad_inputs),
            token_inputs=tuple(grad_inputs),
            kwargs=fixed,
            threads_kwarg="threads",
        ),
        Subject(
            name=f"grad_x_w[native:{kernel}]",
            fn=lambda x, g_agg, g_proj, coef, h_pre, **kw: native.grad_x_w(
                x, g_agg, weight, g_proj, coef, h_pre, n, True, True, **kw
            ),
            inputs=dict(grad_inputs),
            token_inputs=tuple(grad_inputs),
            kwargs=fixed,
            threads_kwarg="threads",
            per_token_outputs=(0,),
        ),
    ]


def _record(request: pytest.FixtureRequest, verdict: Verdict) -> Verdict:
    """The verdict as the test's `determinism` property (it crosses xdist; conftest prints the table)."""
    request.node.user_properties.append(("determinism", verdict.to_json()))
    return verdict


OP_PROBES = [
    *(("reference", op) for op in ("pre", "single_pass_pre", "h_post_bda", "h_aggregate", "sinkhorn")),
    *(("compiled", op) for op in ("pre", "h_post_bda", "h_aggregate", "sinkhorn")),
]
"""The ops probed per backend. The compiled single-pass pre is not probed on its own: it runs the per-sublayer pre's
native passes (`pre_forward_single_pass` per kernel, `grad_h`, `grad_x`, probed below) and gate graphs (its own
probe cost CI 35 s of compilation). cuTile's verdicts are the GPU job's (`ci/gpu_check.sh`)."""


@pytest.mark.parametrize(("backend", "op"), OP_PROBES, ids=lambda v: v)
def test_op_is_bitwise_run_to_run(backend, op, request):
    """The op, forward and every gradient, twice on the same inputs: bitwise equal; its batch and thread
    verdicts are recorded for the table."""
    ok, why = dispatch.availability(backend, "cpu")
    if not ok:
        pytest.skip(f"backend {backend} unavailable: {why}")
    subject = next(s for s in _op_subjects(backend) if s.name.startswith(f"{op}["))
    verdict = _record(request, probe(subject))
    assert verdict.run_to_run == 0.0, verdict.cell()


def _native_subject(kernel: str, op: str) -> Subject:
    ok, why = native.built()
    if not ok:
        pytest.skip(why)
    if kernel not in native.kernels():
        pytest.skip(f"this CPU lacks the instructions of the {kernel} kernel (it runs {native.kernels()})")
    return next(s for s in _native_subjects(kernel) if s.name.startswith(f"{op}["))


@pytest.mark.parametrize("kernel", native.KERNELS)
@pytest.mark.parametrize("op", ["pre_forward", "pre_forward_single_pass", "grad_h", "grad_x"])
def test_native_per_token_pass_is_bitwise_batch_and_thread_invariant(kernel, op, request):
    """Each native kernel, forced, on its per-token results (the forward, d h_pre, d x): bitwise run to run, a
    token's results independent of the other tokens and of the thread count (its threads= and torch's)."""
    subject = _native_subject(kernel, op)
    verdict = _record(request, probe(subject))
    assert verdict.bitwise, f"{subject.name}: {verdict.cell()}"


@pytest.mark.parametrize("kernel", native.KERNELS)
def test_native_weight_gradient_is_bitwise_for_a_thread_count(kernel, request):
    """d W (a sum over tokens, one partial sum per thread's slice of tokens, then the slices' sums in order):
    bitwise run to run and d x batch invariant; across thread counts it moves by the fp32 rounding of a
    re-associated sum (recorded, and bounded here by fp32's forward tolerance relative to |d W|)."""
    subject = _native_subject(kernel, "grad_x_w")
    verdict = _record(request, probe(subject))
    assert verdict.run_to_run == 0.0 and verdict.batch == 0.0, verdict.cell()
    g_w = subject.fn(**subject.inputs, **subject.kwargs)[1]
    tol = tolerance(torch.float32, "fwd")
    bound = tol.rtol * float(g_w.abs().max()) + tol.atol
    assert verdict.threads is not None and verdict.threads <= bound, f"{verdict.cell()} (bound {bound:.3g})"
