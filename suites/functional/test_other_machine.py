"""One box standing in for another: goldens recorded under one CPU numerics profile, the main job run
under another, as a new user's machine of another x86 model would run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.launch.runs import REPO_ROOT
from harness.training.numerics import CPU_NUMERICS_ENV_VAR, CpuNumerics
from suites.functional.session import PLANT_ENV_VAR

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp1_pp1"
"""The cheapest recipe: one rank, no mHC (the lanes are what is under test here)."""
RECORDED_ON = CpuNumerics.BASELINE
RUN_ON = CpuNumerics.AVX2


def _harness(
    args: list[str], *, profile: CpuNumerics, plant: dict | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (PLANT_ENV_VAR, "MHC_HW")}
    env[CPU_NUMERICS_ENV_VAR] = profile.value
    if plant:
        env[PLANT_ENV_VAR] = json.dumps(plant)
    proc = subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    return proc


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, hw_key: str, functional_runs) -> Path:
    """A golden store holding CASE recorded (one repeat) under the `baseline` profile."""
    reason = functional_runs.skip_reason(CASE)
    if reason:
        pytest.skip(reason)
    golden = tmp_path_factory.mktemp("other-machine") / "golden"
    proc = _harness(
        ["recalibrate", "functional", CASE, "--repeats", "1", "--hw", hw_key, "--golden-dir", str(golden)],
        profile=RECORDED_ON,
    )
    assert proc.returncode == 0, proc.stderr
    return golden


def _main_job(golden: Path, out: Path, hw: str, **kw) -> subprocess.CompletedProcess:
    return _harness(
        [
            "run",
            "functional",
            "--golden-dir",
            str(golden),
            "--out",
            str(out),
            "--hw",
            hw,
            "--no-plots",
            f"--pytest-args=--mhc-case={CASE}",
        ],
        profile=RUN_ON,
        **kw,
    )


def test_main_job_on_another_machine_passes_with_exact_na(recorded, tmp_path, hw_key):
    """Under another profile the main job passes: the exact lane is reported n/a (in the summary, the
    report and JUnit), naming both fingerprints, and the approximate lane decides."""
    meta = json.loads((recorded / hw_key / "functional" / f"{CASE}.meta.json").read_text())
    recorded_id = meta["numerics"]["id"]
    assert meta["numerics"]["fingerprint"]["pins"]["ATEN_CPU_CAPABILITY"] == "default"
    proc = _main_job(recorded, tmp_path / "out", hw_key)
    assert proc.returncode == 0, proc.stdout[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(f"functional/{CASE}: decided by"))
    assert line.startswith(
        f"functional/{CASE}: decided by the approximate lane; exact: n/a, recorded on {recorded_id} ("
    )
    this = line.split("; this machine ")[1]
    assert not this.startswith(recorded_id) and "ATen AVX2" in this
    assert "[functional] done: 1/1 tests, 0 failed" in proc.stdout
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"| functional | {CASE} | approximate | exact: n/a, recorded on {recorded_id}" in report
    assert f"| functional | {CASE} | lm loss | exact | n/a | - |" in report
    case = next(ET.parse(tmp_path / "out" / "junit-functional.xml").getroot().iter("testcase"))
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["golden_lane"] == "approximate" and props["golden_exact"].startswith(
        "exact: n/a, recorded on"
    )


def test_planted_regression_fails_on_another_machine(recorded, tmp_path, hw_key):
    """The same main job with a learning-rate warm-up one step longer fails, naming metric and steps."""
    proc = _main_job(recorded, tmp_path / "out", hw_key, plant={"--lr-warmup-iters": 3})
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "FAIL" in proc.stdout.splitlines()[-1]
    assert "lm loss [approx rtol=1e-05 atol=0 max_misses=0]: " in proc.stdout
    assert re.search(
        r"^  step \d+: actual \S+, golden \S+, delta \S+ \(rel \S+\), band \|delta\| <= ", proc.stdout, re.M
    )
    assert "exact: n/a, recorded on" in proc.stdout
