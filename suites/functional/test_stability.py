"""The paper's stability claim at small scale: mHC's composite Amax gain stays 1 in training where
unconstrained Hyper-Connections' grows; the monitor's metrics are in every mHC run, across stages."""

from __future__ import annotations

import statistics

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GAINS = ("mhc-amax-gain-fwd", "mhc-amax-gain-bwd", "mhc-layer-gain-max")


def _run(functional_runs, case):
    reason = functional_runs.skip_reason(case)
    if reason:
        pytest.skip(reason)
    return functional_runs.run(case).metrics


def test_mhc_stays_on_the_manifold_every_step(functional_runs, record_property):
    """gpt_tp1_pp1_mhc: at every step the composite and single-layer gains are 1 within 1e-3, the sums
    of H_res are 1 within 1e-3 and every sublayer applies the matrix its variant says."""
    m = _run(functional_runs, "gpt_tp1_pp1_mhc")
    for name in GAINS:
        worst = max(abs(v - 1) for v in m[name].values())
        assert worst < 1e-3, (name, worst)
    assert max(m["mhc-sum-dev-max"].values()) < 1e-3
    assert max(m["mhc-orientation-err"].values()) < 1e-6
    assert set(m["mhc-monitor-sublayers"].values()) == {4.0}  # 2 layers x (attention, MLP)
    cost = statistics.median(m["mhc-monitor-seconds"].values())
    step = statistics.median(m["iteration-time"].values())
    record_property("mhc_monitor_seconds", cost)
    record_property("mhc_monitor_share_of_step", cost / step)
    print(f"stability monitor: {cost * 1e3:.2f} ms per sampled step, {cost / step:.1%} of the median step")


def test_unconstrained_hyper_connections_grow_where_mhc_does_not(functional_runs):
    """gpt_tp1_pp1_hc (the same model, H_res = I + logits): its composite gain is above mHC's at every
    step and grows over the run, the direction of the paper's figure."""
    hc, mhc = _run(functional_runs, "gpt_tp1_pp1_hc"), _run(functional_runs, "gpt_tp1_pp1_mhc")
    for name in ("mhc-amax-gain-fwd", "mhc-amax-gain-bwd"):
        steps = sorted(hc[name])
        assert all(hc[name][s] > mhc[name][s] + 0.05 for s in steps), name
        assert hc[name][steps[-1]] > hc[name][steps[0]] + 0.1, (name, hc[name][steps[0]], hc[name][steps[-1]])


def test_pipeline_stages_are_joined(functional_runs):
    """gpt_tp2_pp2_mhc: the composite runs over both stages' sublayers (4 layers x 2) and stays 1."""
    m = _run(functional_runs, "gpt_tp2_pp2_mhc")
    assert set(m["mhc-monitor-sublayers"].values()) == {8.0}
    assert max(abs(v - 1) for v in m["mhc-amax-gain-fwd"].values()) < 1e-3
