"""A broken model fails the functional comparison with the step and the numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.golden.case_check import GoldenSettings, check_case
from harness.golden.fingerprint import fingerprint_from_json
from harness.golden.hardware import detect_hardware
from harness.golden.store import GoldenStore

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp1_pp1_mhc_gate1"
"""At upstream's gate init (0.01, `gpt_tp1_pp1_mhc`) H_res stays near uniform, where one Sinkhorn iteration
gives nearly the same matrix as 20: that run moves the loss by an ulp at a few steps, which only the exact
lane of the recording machine sees. At gate 1.0 it moves the loss on every machine."""
BROKEN = {"--mhc-sinkhorn-iterations": 1}
"""A recipe override used only here: 1 Sinkhorn-Knopp iteration instead of 20."""


def _compare_only(config: pytest.Config) -> GoldenSettings:
    """The session's golden dir and hardware key, compare-only: no --update-golden, no results files."""
    opt = config.getoption("golden_dir")
    golden_dir = Path(config.invocation_params.dir, opt).resolve() if opt else Path(config.rootpath, "golden")
    return GoldenSettings(golden_dir=golden_dir, hw=detect_hardware(override=config.getoption("hw")))


def test_changed_sinkhorn_iterations_fail_golden_comparison(functional_runs, request):
    """One Sinkhorn iteration instead of 20: the golden check fails naming metric, step and values, in the
    approximate lane on any machine (and the exact lane where it applies); nothing is written."""
    reason = functional_runs.skip_reason(CASE)
    if reason:
        pytest.skip(reason)
    hw = functional_runs.hw
    settings = _compare_only(request.config)
    files = GoldenStore(settings.golden_dir).files(hw, "functional", CASE)
    if not files.json.is_file():
        pytest.skip(f"no golden file {files.json} yet (see test_golden_case[{CASE}])")
    before = {p: p.read_bytes() for p in files.json.parent.iterdir()}

    broken = functional_runs.fresh(CASE, "broken", overrides=BROKEN)
    assert broken.plan.args.mhc_sinkhorn_iterations == 1
    outcome = check_case(
        settings,
        suite="functional",
        case=CASE,
        metrics=broken.metrics,
        checks=functional_runs.recipe(CASE).checks(hw),
        fingerprint=fingerprint_from_json(broken.fingerprint, source="broken run"),
    )

    assert outcome.status == "fail", outcome.message
    msg = outcome.message
    assert f"golden mismatch for functional/{CASE} on {hw}" in msg
    # The approximate lane fails on every machine, whether or not the exact lane applies here.
    assert "lm loss [approx" in msg and "steps outside the band" in msg, msg
    assert re.search(
        r"^  step \d+: actual \S+, golden \S+, delta \S+ \(rel \S+\), band \|delta\| <= \S+$", msg, re.M
    ), msg
    if outcome.lane == "exact":
        assert "lm loss [exact]" in msg and "steps differ" in msg
        assert re.search(
            r"^  step \d+: actual \S+, golden \S+, delta \S+ \(rel \S+\), band delta == 0$", msg, re.M
        ), msg
    else:
        assert "exact: n/a, recorded on" in msg, msg
    assert {p: p.read_bytes() for p in files.json.parent.iterdir()} == before, "a golden file was written"
