"""The fused mHC ops in a real training run: the same losses, grad norms and zero counts as the
reference ops, within float rounding (the fused kernels sum in another order), under the kernel
`auto` picks and under every other native CPU kernel this CPU runs."""

from __future__ import annotations

import pytest

from harness.golden.bands import DEFAULT_BANDS
from harness.golden.compare import ApproximateCheck, compare, format_results
from harness.golden.schema import to_golden
from harness.training.metrics import GRAD_NORM, LM_LOSS, NUM_ZEROS
from mhc_core.kernels import native

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp1_pp1_mhc"
FUSED = {"--use-fused-mhc": True}
"""Upstream's flag: the ops go through the kernel dispatch."""
CHECKS = {
    LM_LOSS: ApproximateCheck(rtol=1e-5, max_misses=0),
    GRAD_NORM: ApproximateCheck(rtol=1e-5, max_misses=0),
    NUM_ZEROS: DEFAULT_BANDS[NUM_ZEROS],
}
"""fp32. Measured on the CPU (compiled backend, 24 steps, each native kernel forced and the compiled graph
without them; `docs/measurements/cpu-2026-12-06-num-zeros/`): lm loss within 1.5e-7 and grad norm within
2.5e-7 relative of the reference run at every step. num-zeros (exactly-zero gradient elements) is off by
up to 2 (`avx2`: +2 at step 4), 1 under every other kernel: every flip is in the attention's key bias,
whose gradient is zero in exact arithmetic (softmax ignores a shift shared by every key) and so is
rounding noise (|g| ~ 1e-12, against 1e-6 to 1e-3 for the query and value biases): which of its 128
elements round to exactly 0 depends on the summation order. The default band (atol 4) holds it, with
the numerics profiles' own flips of 0 to 2."""


def _fused_backend(device: str) -> str:
    """cuTile where it runs (an NVIDIA GPU with cuda-tile), else compiled: forced through
    `MHC_BACKEND`, so an unavailable backend fails the run instead of `auto` falling back to the
    reference ops."""
    from mhc_core.kernels import dispatch

    return "cutile" if device == "cuda" and dispatch.availability("cutile", "cuda")[0] else "compiled"


def _skip_reason(kernel: str, device: str) -> str | None:
    """Why the fused run under `MHC_NATIVE=<kernel>` does not run here ("auto" always runs)."""
    if kernel == "auto":
        return None
    if device != "cpu":
        return f"MHC_NATIVE={kernel}: the native kernels take CPU tensors; this case runs on {device}"
    built, why = native.built()
    if not built:
        return why
    if kernel not in native.kernels():
        return (
            f"this CPU lacks the instructions of the {kernel} kernel (it runs {', '.join(native.kernels())})"
        )
    if kernel == native.auto_kernel():
        return f"`auto` runs {kernel} on this CPU: the [auto] case is its run"
    if kernel == "avx512" and native.auto_kernel() == "avx512_bf16":
        # This fp32 recipe's mapping computes in fp32, where avx512_bf16 runs avx512's code, bit for bit
        # (test_native_pre.py::test_avx512_bf16_is_avx512_but_for_the_bf16_mapping).
        return "fp32 mappings: `auto`'s avx512_bf16 runs avx512's code here, the same bits: the [auto] case is its run"
    return None


@pytest.mark.parametrize("kernel", ["auto", *native.KERNELS])
def test_fused_mhc_run_matches_the_reference_run(functional_runs, monkeypatch, kernel):
    """With `--use-fused-mhc` (and `MHC_NATIVE=<kernel>`) lm loss and grad norm match the reference-ops run at
    every step, num-zeros within its band."""
    reference = functional_runs.deterministic_run(CASE)
    device = "cuda" if functional_runs.recipe(CASE).hardware[functional_runs.hw].backend == "nccl" else "cpu"
    reason = _skip_reason(kernel, device)
    if reason:
        pytest.skip(reason)
    backend = _fused_backend(device)
    monkeypatch.setenv("MHC_BACKEND", backend)  # the ranks inherit the environment
    if kernel == "auto":
        monkeypatch.delenv(native.ENV, raising=False)
    else:
        monkeypatch.setenv(native.ENV, kernel)
    fused = functional_runs.fresh(CASE, f"fused-{kernel}", overrides=FUSED)
    assert fused.plan.args.use_fused_mhc and not reference.plan.args.use_fused_mhc
    pins = fused.fingerprint.get("pins", {})
    assert pins.get(native.ENV) == (None if kernel == "auto" else kernel), pins
    results = compare(
        to_golden({n: fused.metrics[n] for n in CHECKS}),
        to_golden({n: reference.metrics[n] for n in CHECKS}),
        CHECKS,
        source=f"reference-ops run of {CASE} (fused: MHC_BACKEND={backend}, {native.ENV}={kernel})",
    )
    assert all(r.ok for r in results), format_results(results)
