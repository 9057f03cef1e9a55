"""The nightly's output a person looks at, and the CI definitions that schedule it, checked without a GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

ROOT = Path(__file__).resolve().parents[3]
H200_RUN = ROOT / "docs" / "measurements" / "h200-2026-11-30" / "run1-perf.json"


def test_the_nightly_steps_on_the_recorded_h200_run(tmp_path, capsys):
    """The nightly script's history steps on the H200 run's perf.json: append, check, plot and the page,
    which names the commit, holds every benchmark's row and links every trend plot it drew."""
    history, out = tmp_path / "h200.jsonl", tmp_path / "trends"
    assert 0 == main(["perf-history", "append", str(H200_RUN), "--history", str(history), "--hw", "h200"])
    assert 0 == main(["perf-history", "check", "--history", str(history)])
    assert 0 == main(["perf-history", "plot", "--history", str(history), "--out", str(out)])
    page = (out / "h200.md").read_text()
    n = len(json.loads(H200_RUN.read_text())["benchmarks"])
    assert page.startswith("# Nightly perf: h200") and "**0 regression(s)**" in page
    assert sum(line.startswith("| ") and "first point" in line for line in page.splitlines()) == n
    linked = {line.split("](")[1].rstrip(")") for line in page.splitlines() if line.startswith("![")}
    assert linked and all((out / p).is_file() for p in linked)
    assert linked == {p.name for p in out.glob("*.png")}


def test_a_regression_is_marked_on_the_page(tmp_path):
    """A second night 2x slower on one benchmark marks that row REGRESSION in bold and counts it."""
    history, out = tmp_path / "h200.jsonl", tmp_path / "trends"
    assert 0 == main(["perf-history", "append", str(H200_RUN), "--history", str(history), "--hw", "h200"])
    doc = json.loads(H200_RUN.read_text())
    doc["benchmarks"][0]["stats"]["median"] *= 2
    doc["benchmarks"][0]["extra_info"]["median_s"] = doc["benchmarks"][0]["stats"]["median"]
    slower = tmp_path / "night2.json"
    slower.write_text(json.dumps(doc))
    assert 0 == main(["perf-history", "append", str(slower), "--history", str(history), "--hw", "h200"])
    assert 1 == main(["perf-history", "check", "--history", str(history)])  # the nightly job fails on it
    assert 0 == main(["perf-history", "plot", "--history", str(history), "--out", str(out)])
    page = (out / "h200.md").read_text()
    assert "**1 regression(s)**" in page and page.count("**REGRESSION +") == 1
    assert "2 run(s) in the history" in page


@pytest.mark.parametrize(
    ("schema", "paths"),
    [
        ("vendor.github-workflows", [".github/workflows/cpu.yml", ".github/workflows/nightly-gpu.yml"]),
        ("vendor.gitlab-ci", [".gitlab-ci.yml"]),
    ],
)
def test_ci_definitions_validate_and_a_broken_one_does_not(tmp_path, schema, paths):
    """The workflow files and the GitLab file pass their published schemas (check-jsonschema's vendored
    copies, no network); the same file with a job missing its runner fails."""
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    if not Path(exe).exists():
        pytest.skip("check-jsonschema is not installed (the test extra has it)")
    ok = subprocess.run(
        [exe, "--builtin-schema", schema, *[str(ROOT / p) for p in paths]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / Path(paths[0]).name
    text = (ROOT / paths[0]).read_text()
    broken.write_text(
        text.replace("runs-on:", "runs_on:")
        if "github" in schema
        else text.replace("stage: test", "stage: [1]")
    )
    bad = subprocess.run(
        [exe, "--builtin-schema", schema, str(broken)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0, bad.stdout
