"""The nightly GPU job's script, end to end on the CPU: one small kernel case through `ci/nightly_gpu.sh`.

The same script runs on an H100 / H200 node; here it records a first perf golden (as a first
night on new hardware does, `--update-golden=all`), appends the run to a perf history, checks it,
draws the trend plot and writes the table. Only one run: a second one would compare two timings
of a shared box, which is a benchmark, not a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASE = "h_aggregate-T4096-n4-C256-fp32"
SELECT = f"test_kernel and {CASE}-fwd-compiled"


def test_nightly_script_records_golden_history_plot_and_table(tmp_path):
    """ci/nightly_gpu.sh on one CPU case writes the backend report, a perf golden + sidecar, one history
    record, a trend PNG and the table."""
    golden, out, history = tmp_path / "golden", tmp_path / "nightly", tmp_path / "history" / "cpu.jsonl"
    nightly = {k: v for k, v in os.environ.items() if k != "MHC_PERF_SMOKE"}  # the nightly is no smoke run
    env = dict(
        nightly,
        MHC_PYTHON=sys.executable,
        MHC_NIGHTLY_OUT=str(out),
        MHC_PERF_HISTORY=str(history),
        MHC_PERF_REPS="3",
        MHC_HW="cpu_nightly_test",
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "ci" / "nightly_gpu.sh"),
            "-q",
            "-k",
            SELECT,
            "--golden-dir",
            str(golden),
            "--update-golden=all",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    case_file = golden / "cpu_nightly_test" / "perf" / f"{CASE}-fwd-compiled.json"
    assert case_file.is_file(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    metrics = json.loads(case_file.read_text())
    times = metrics["iteration-time"]["values"]
    assert len(times) == 3 and all(v > 0 for v in times.values()), metrics
    assert case_file.with_name(case_file.stem + ".meta.json").is_file()

    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(records) == 1 and records[0]["hardware"] == "cpu_nightly_test"
    (bench,) = records[0]["benchmarks"]
    assert bench["median_s"] > 0 and bench["extra_info"]["shape"] == CASE, bench
    assert bench["extra_info"]["roofline_ratio"] > 0

    backends = (out / "backends.txt").read_text()
    assert all(f"  {op} " in backends for op in ("sinkhorn", "mapping", "h_aggregate", "h_post_bda")), (
        backends
    )
    assert "ok: the first mHC call of such a run does not raise" in backends, backends
    assert list((out / "trends").glob("*.png")), sorted(p.name for p in out.rglob("*"))
    table = (out / "perf-table.md").read_text()
    assert "| h_aggregate | fwd | compiled | T4096-n4-C256-fp32 |" in table, table
