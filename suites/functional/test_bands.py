"""The default bands (harness.golden.bands) against measured drift: numerics-only changes fit, real changes fail.

The recorded runs are `docs/measurements/cpu-numerics-drift/` (`python -m suites.functional.drift`):
each case under the `avx2`, `baseline` and `native` CPU numerics profiles on one machine, the
same case's golden values as recorded on another x86 model, and deliberate changes (another mHC
variant, a warm-up one step longer). The live tests add this machine's own drift.
"""

from __future__ import annotations

import json

import pytest

from harness.golden.bands import DEFAULT_BANDS
from harness.golden.compare import CheckResult, compare_metric
from harness.golden.schema import Golden, MetricSeries, load_golden, to_golden
from harness.launch.runs import REPO_ROOT
from harness.training.numerics import CpuNumerics

DRIFT = REPO_ROOT / "docs" / "measurements" / "cpu-numerics-drift"
CASES = ("gpt_tp1_pp1", "gpt_tp1_pp1_mhc", "gpt_tp1_pp1_mhc_gate1", "gpt_tp1_pp1_hc", "gpt_tp2_pp2_mhc")
NUMERICS_ONLY = [
    (c, p.name)
    for c in CASES
    for p in sorted((DRIFT / c).glob("*.json"))
    if not p.name.startswith("change-") and not p.name.endswith(".fingerprint.json") and p.name != "avx2.json"
]
REAL_CHANGES = {
    # (case, run): the metrics that must fail, each at least at this many steps
    ("gpt_tp1_pp1", "change-warmup.json"): {"lm loss": 15, "grad-norm": 15},
    ("gpt_tp1_pp1_mhc", "change-warmup.json"): {"lm loss": 15, "grad-norm": 15},
    ("gpt_tp1_pp1_mhc_gate1", "change-warmup.json"): {"lm loss": 15, "grad-norm": 15},
    ("gpt_tp1_pp1_mhc_gate1", "change-variant-dev.json"): {"lm loss": 10, "grad-norm": 10},
    ("gpt_tp1_pp1_mhc_gate1", "change-variant-paper.json"): {"lm loss": 1},
}


def _verdicts(actual: Golden, reference: Golden) -> dict[str, CheckResult]:
    """Every default band's verdict on the metrics both runs hold (the AMD goldens of 2026-11-30 predate
    the stability metrics; the baseline case has none)."""
    return {
        m: compare_metric(m, actual.get(m), reference.get(m), band, source="avx2.json")
        for m, band in DEFAULT_BANDS.items()
        if m in actual and m in reference
    }


@pytest.mark.parametrize(
    ("case", "run"), NUMERICS_ONLY, ids=[f"{c}-{r.removesuffix('.json')}" for c, r in NUMERICS_ONLY]
)
def test_numerics_drift_fits_the_default_bands(case, run):
    """A run under another ISA profile, or on another x86 model, passes every default band."""
    reference = load_golden(DRIFT / case / "avx2.json")
    for result in _verdicts(load_golden(DRIFT / case / run), reference).values():
        assert result.ok, result.message


def test_the_drift_runs_are_what_they_say():
    """Each profile's recorded fingerprint carries that profile's pins; every case has all profiles."""
    for case in CASES:
        for profile in CpuNumerics:
            fp = json.loads((DRIFT / case / f"{profile.value}.fingerprint.json").read_text())
            aten = fp["pins"].get("ATEN_CPU_CAPABILITY")
            assert aten == {"avx2": "avx2", "baseline": "default", "native": None}[profile.value], (case, fp)


@pytest.mark.parametrize(
    ("case", "run"), list(REAL_CHANGES), ids=[f"{c}-{r.removesuffix('.json')}" for c, r in REAL_CHANGES]
)
def test_a_real_change_fails_the_default_bands(case, run):
    """Another mHC variant (where the mixing is non-trivial) or a warm-up one step longer fails."""
    verdicts = _verdicts(load_golden(DRIFT / case / run), load_golden(DRIFT / case / "avx2.json"))
    for metric, at_least in REAL_CHANGES[(case, run)].items():
        r = verdicts[metric]
        assert r.status == "fail" and r.n_misses >= at_least, r.message


@pytest.mark.parametrize("step", [1, 7, 24])
def test_a_one_step_lm_loss_shift_of_1e_3_fails(step):
    """1e-3 relative at a single step of an otherwise identical curve fails, naming that step."""
    reference = load_golden(DRIFT / "gpt_tp1_pp1_mhc" / "avx2.json")["lm loss"]
    values = dict(reference.values)
    values[step] *= 1 + 1e-3
    shifted = MetricSeries(
        start_step=reference.start_step,
        end_step=reference.end_step,
        step_interval=reference.step_interval,
        values=values,
    )
    r = compare_metric("lm loss", shifted, reference, DEFAULT_BANDS["lm loss"])
    assert r.status == "fail" and r.n_misses == 1 and r.worst_step == step
    assert f"  step {step}: actual " in r.message


@pytest.mark.distributed
@pytest.mark.slow
def test_this_machines_drift_fits_the_default_bands(functional_runs):
    """Here, now: the session's run and a run under the `baseline` profile differ in fingerprint and fit
    the default bands."""
    case = "gpt_tp1_pp1_mhc"
    reason = functional_runs.skip_reason(case)
    if reason:
        pytest.skip(reason)
    run = functional_runs.run(case)
    other = functional_runs.fresh(case, "baseline-profile", numerics=CpuNumerics.BASELINE)
    assert other.fingerprint != run.fingerprint
    assert other.fingerprint["pins"].get("ATEN_CPU_CAPABILITY") == "default"
    for result in _verdicts(to_golden(other.metrics), to_golden(run.metrics)).values():
        assert result.ok, result.message


def test_drift_files_are_committed():
    """The measurement the bands rest on is in the repository (not a fixture that could be empty): every
    case under every profile, and the three older cases as recorded on the AMD EPYC."""
    for case in CASES:
        runs = {r for c, r in NUMERICS_ONLY if c == case}
        assert {"baseline.json", "native.json"} <= runs, (case, runs)
        assert ("amd-epyc-avx2.json" in runs) == (case not in ("gpt_tp1_pp1_mhc_gate1", "gpt_tp1_pp1_hc")), (
            case,
            runs,
        )
        assert (DRIFT / case / "drift.txt").is_file()
