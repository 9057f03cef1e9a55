"""The fused mHC ops in a real training run: the same losses, grad norms and zero counts as the
reference ops, within float rounding (the fused kernels sum in another order)."""

from __future__ import annotations

import pytest

from harness.compare import ApproximateCheck, compare, format_results
from harness.schema import to_golden
from harness.training.metrics import GRAD_NORM, LM_LOSS, NUM_ZEROS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp1_pp1_mhc"
FUSED = {"--use-fused-mhc": True}
"""Upstream's flag: the ops go through the kernel dispatch."""
CHECKS = {LM_LOSS: ApproximateCheck(rtol=1e-5, max_misses=0), GRAD_NORM: ApproximateCheck(rtol=1e-5, max_misses=0),
          NUM_ZEROS: ApproximateCheck(atol=1, max_misses=0)}
"""fp32. Measured on the CPU (compiled backend, 24 steps): lm loss and grad norm within 1.4e-7
relative of the reference run at every step; num-zeros (exactly-zero gradient elements) off by one
at 3 of 24 steps, as a gradient element that is exactly 0 in one summation order need not be in another."""


def _fused_backend(device: str) -> str:
    """cuTile where it runs (an NVIDIA GPU with cuda-tile), else compiled: forced through
    `MHC_BACKEND`, so an unavailable backend fails the run instead of `auto` falling back to the
    reference ops."""
    from mhc_core.kernels import dispatch

    return "cutile" if device == "cuda" and dispatch.availability("cutile", "cuda")[0] else "compiled"


def test_fused_mhc_run_matches_the_reference_run(functional_runs, monkeypatch):
    """With `--use-fused-mhc` lm loss and grad norm match the reference-ops run at every step, num-zeros within one."""
    reference = functional_runs.deterministic_run(CASE)
    device = "cuda" if functional_runs.recipe(CASE).hardware[functional_runs.hw].backend == "nccl" else "cpu"
    backend = _fused_backend(device)
    monkeypatch.setenv("MHC_BACKEND", backend)  # the ranks inherit the environment
    fused = functional_runs.fresh(CASE, "fused", overrides=FUSED)
    assert fused.plan.args.use_fused_mhc and not reference.plan.args.use_fused_mhc
    results = compare(to_golden({n: fused.metrics[n] for n in CHECKS}),
                      to_golden({n: reference.metrics[n] for n in CHECKS}), CHECKS,
                      source=f"reference-ops run of {CASE} (fused: MHC_BACKEND={backend})")
    assert all(r.ok for r in results), format_results(results)
