"""Perf history: append pytest-benchmark JSON, detect regressions and improvements, plot trends."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.golden.errors import GoldenFormatError
from harness.perf.history import check_history, read_history, record_from_benchmark_json


def _bench_json(path, medians: dict[str, float], *, commit="abc123", date="2026-11-01T00:00:00+00:00"):
    """A minimal pytest-benchmark JSON file with one benchmark per name."""
    doc = {
        "machine_info": {
            "node": "x",
            "python_version": "3.11.7",
            "mhc": {"cuda_graph": False, "cutile_tuning": "tuned/nvidia_h200.json (NVIDIA H200, n = 4)"},
        },
        "commit_info": {"id": commit, "dirty": False, "branch": "main"},
        "datetime": date,
        "version": "5.3.1",
        "benchmarks": [
            {
                "group": "sinkhorn",
                "name": name,
                "fullname": f"suites/perf/test_k.py::{name}",
                "params": {"T": 512},
                "extra_info": {"bytes_per_s": 1e9 / m, "roofline_ratio": 0.5},
                "stats": {"min": m, "max": m, "mean": m, "stddev": 0.0, "median": m, "rounds": 10},
            }
            for name, m in medians.items()
        ],
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def history(tmp_path):
    """A history of five runs at 1 ms for two benchmarks, on cpu_x86_64."""
    h = tmp_path / "history.jsonl"
    for i in range(5):
        f = _bench_json(tmp_path / f"b{i}.json", {"test_a[T512]": 1e-3, "test_b[T512]": 2e-3}, commit=f"c{i}")
        assert 0 == main(["perf-history", "append", str(f), "--history", str(h), "--hw", "cpu_x86_64"])
    return h


def _append(tmp_path, h, a, b):
    f = _bench_json(tmp_path / "new.json", {"test_a[T512]": a, "test_b[T512]": b}, commit="new")
    assert 0 == main(["perf-history", "append", str(f), "--history", str(h), "--hw", "cpu_x86_64"])


class TestAppend:
    def test_record_fields(self, history):
        """Each run is one JSONL record with date, commit, hardware, versions, the suite's settings and
        per-benchmark figures."""
        rec = read_history(history)[-1]
        assert ("c4", "cpu_x86_64") == (rec["commit"], rec["hardware"])
        assert "torch" in rec["versions"]
        assert rec["settings"]["cutile_tuning"].startswith("tuned/nvidia_h200.json")
        b = rec["benchmarks"][0]
        assert ("sinkhorn::test_a[T512]", 1e-3) == (b["key"], b["median_s"])
        assert 0.5 == b["extra_info"]["roofline_ratio"]

    def test_bad_benchmark_file(self, tmp_path):
        """A benchmark without a positive median is refused, naming the file and index."""
        doc = {"benchmarks": [{"name": "x", "stats": {"median": 0}}]}
        with pytest.raises(GoldenFormatError, match=r"f\.json: benchmarks\[0\] \(x\): stats\.median=0"):
            record_from_benchmark_json(doc, source="f.json", hw="h200")


class TestCheck:
    def test_steady_passes(self, history, tmp_path, capsys):
        """A run within the band passes with exit 0."""
        _append(tmp_path, history, 1.05e-3, 2e-3)
        assert 0 == main(["perf-history", "check", "--history", str(history)])
        out = capsys.readouterr().out
        assert "OK" in out and "1.05" in out, out  # the new run is the one checked

    def test_regression_detected(self, history, tmp_path, capsys):
        """A run 20% slower than the trailing median fails, printing measured, baseline, delta and band."""
        _append(tmp_path, history, 1.2e-3, 2e-3)
        assert 1 == main(["perf-history", "check", "--history", str(history)])
        out = capsys.readouterr().out
        assert (
            "REGRESSION   sinkhorn::test_a[T512]: measured 1.2 ms, baseline 1 ms (median of 5), delta +20.0%, "
            "band -20%..+10%"
        ) in out

    def test_improvement_flagged(self, history, tmp_path, capsys):
        """A run much faster than the band is flagged IMPROVED (exit 0 unless --fail-on-improvement)."""
        _append(tmp_path, history, 0.5e-3, 2e-3)
        assert 0 == main(["perf-history", "check", "--history", str(history)])
        assert "IMPROVED     sinkhorn::test_a[T512]" in capsys.readouterr().out
        assert 1 == main(["perf-history", "check", "--history", str(history), "--fail-on-improvement"])

    def test_window_and_hardware(self):
        """The baseline is the median of the last K records of the newest record's hardware key."""
        recs = [
            {"hardware": hw, "benchmarks": [{"key": "k", "median_s": m}]}
            for hw, m in [("cpu", 7.0), ("cpu", 1.0), ("cpu", 2.0), ("h200", 9.0), ("cpu", 2.0)]
        ]
        (v,) = check_history(recs, window=2)
        assert (1.5, 2, "regression") == (v.baseline_s, v.n_baseline, v.status)

    def test_no_baseline(self, tmp_path):
        """The first record has no baseline and passes."""
        (v,) = check_history([{"hardware": "cpu", "benchmarks": [{"key": "k", "median_s": 1.0}]}])
        assert "no_baseline" == v.status

    def test_malformed_history_line(self, tmp_path):
        """A broken history line is named by number."""
        h = tmp_path / "h.jsonl"
        h.write_text('{"hardware": "x", "benchmarks": []}\n{oops\n')
        with pytest.raises(GoldenFormatError, match=r"h\.jsonl line 2: malformed JSON"):
            read_history(h)


class TestPlot:
    def test_png_per_group(self, history, tmp_path, capsys):
        """plot writes one trend PNG per hardware and benchmark group, and the hardware's summary page."""
        assert 0 == main(
            ["perf-history", "plot", "--history", str(history), "--out", str(tmp_path / "plots")]
        )
        pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
        assert ["perf_cpu_x86_64_sinkhorn.png"] == pngs
        assert sorted(p.name for p in (tmp_path / "plots").glob("*.md")) == ["cpu_x86_64.md"]
        assert (tmp_path / "plots" / pngs[0]).read_bytes().startswith(b"\x89PNG")


class TestBenchmarkPlugin:
    def test_machine_info_carries_hw(self, pytester, tmp_path, monkeypatch):
        """A pytest-benchmark run records the hardware key, which `append` then uses, and the commit the run
        names in `$MHC_GIT_COMMIT` (a copy of the tree has a HEAD of its own)."""
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # benchmarks disable themselves under xdist
        monkeypatch.setenv("MHC_GIT_COMMIT", "00524bc61082e7a0fd87038982ccfc610c762a4f")
        pytester.makeini("[pytest]\n")
        pytester.makepyfile(test_b="def test_b(benchmark):\n    benchmark(lambda: None)\n")
        out = tmp_path / "bench.json"
        pytester.runpytest(
            "-p",
            "no:hypothesispytest",
            "-p",
            "no:xdist",
            "--hw=h200",
            f"--benchmark-json={out}",
            "--benchmark-min-rounds=1",
            "--benchmark-max-time=0.001",
        ).assert_outcomes(passed=1)
        assert "h200" == json.loads(out.read_text())["machine_info"]["mhc_hw"]
        assert 0 == main(["perf-history", "append", str(out), "--history", str(tmp_path / "h.jsonl")])
        record = read_history(tmp_path / "h.jsonl")[0]
        assert ("h200", "00524bc61082e7a0fd87038982ccfc610c762a4f") == (record["hardware"], record["commit"])


class TestBadHistoryInput:
    def test_append_refuses_a_history_with_an_incomplete_last_line(self, history, tmp_path, capsys):
        """Appending after a line without its newline (a killed writer) is refused, the file left as it was."""
        text = history.read_text()
        history.write_text(text[:-1])  # the last record without its newline
        f = _bench_json(tmp_path / "new.json", {"test_a[T512]": 1e-3}, commit="new")
        assert 1 == main(["perf-history", "append", str(f), "--history", str(history), "--hw", "cpu_x86_64"])
        assert "the last line is incomplete" in capsys.readouterr().err
        assert history.read_text() == text[:-1]

    @pytest.mark.parametrize(
        ("bench", "match"),
        [
            ({"name": "x"}, r"benchmarks\[0\]: not a benchmark"),
            ({"key": "g::x", "name": "x", "median_s": "slow"}, r"benchmarks\[0\] \(g::x\): median_s='slow'"),
            (
                {"key": "g::x", "name": "x", "median_s": 1e-3, "extra_info": [1]},
                r"benchmarks\[0\] \(g::x\): extra_info must be an object",
            ),
        ],
        ids=["no-key", "median-str", "extra-list"],
    )
    def test_read_refuses_malformed_benchmarks(self, tmp_path, bench, match):
        """A benchmark entry without key / name, with a non-numeric median or a non-object extra_info is named."""
        h = tmp_path / "h.jsonl"
        h.write_text(json.dumps({"hardware": "x", "benchmarks": [bench]}) + "\n")
        with pytest.raises(GoldenFormatError, match=rf"h\.jsonl line 1: {match}"):
            read_history(h)

    def test_append_refuses_non_finite_extra_info_and_bad_hw(self, tmp_path, capsys):
        """A NaN in extra_info is refused naming the file and benchmark; an invalid --hw is refused; nothing written."""
        f = _bench_json(tmp_path / "b.json", {"test_a[T512]": 1e-3})
        doc = json.loads(f.read_text())
        doc["benchmarks"][0]["extra_info"]["roofline_ratio"] = float("nan")
        f.write_text(json.dumps(doc))
        h = tmp_path / "h.jsonl"
        assert 1 == main(["perf-history", "append", str(f), "--history", str(h), "--hw", "cpu_x86_64"])
        assert (
            "b.json: benchmarks[0] (test_a[T512]): extra_info holds non-finite values"
            in capsys.readouterr().err
        )
        good = _bench_json(tmp_path / "g.json", {"test_a[T512]": 1e-3})
        assert 2 == main(["perf-history", "append", str(good), "--history", str(h), "--hw", "BAD/HW"])
        assert "--hw='BAD/HW' is not a valid hardware key" in capsys.readouterr().err
        assert not h.exists()

    def test_check_refuses_an_empty_newest_record_and_a_band_of_100_percent(self, history, capsys):
        """A newest record without benchmarks is an error, not a pass; --band-fast >= 1 is a usage error."""
        with history.open("a") as f:
            f.write(json.dumps({"hardware": "cpu_x86_64", "benchmarks": [], "date": "d"}) + "\n")
        assert 2 == main(["perf-history", "check", "--history", str(history)])
        assert "the newest record (d, cpu_x86_64) has no benchmarks" in capsys.readouterr().err
        with pytest.raises(ValueError, match=r"band_fast=1\.5 must be < 1"):
            check_history(read_history(history)[:-1], band_fast=1.5)

    def test_a_directory_or_missing_file_is_a_refused_input(self, tmp_path, capsys):
        """A history that is a directory or a missing file exits 1 naming the path, without a traceback."""
        assert 1 == main(["perf-history", "check", "--history", str(tmp_path)])
        assert f"error: {tmp_path}: Is a directory" in capsys.readouterr().err
        assert 1 == main(["perf-history", "check", "--history", str(tmp_path / "none.jsonl")])
        assert f"error: {tmp_path / 'none.jsonl'}: No such file or directory" in capsys.readouterr().err

    def test_plot_of_an_empty_history_is_an_error(self, tmp_path, capsys):
        """plot on a history without records says so (exit 2) instead of writing nothing silently."""
        h = tmp_path / "h.jsonl"
        h.write_text("")
        assert 2 == main(["perf-history", "plot", "--history", str(h), "--out", str(tmp_path / "p")])
        assert "the history has no records: nothing to plot" in capsys.readouterr().err
