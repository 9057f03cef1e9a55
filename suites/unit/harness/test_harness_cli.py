"""`mhc-harness run` end to end on a tiny suite, `diff` and `import-megatron`."""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET

import pytest

from harness.cli import main
from harness.golden.schema import dumps_golden, load_golden, series_from_list

HW = "cpu_x86_64"
FAST = "-p no:hypothesispytest -p no:benchmark"
LANES_CASE = """
from harness import ApproximateCheck, ExactCheck


def test_lanes(golden_metrics):
    golden_metrics.check("tiny_lanes", {"lm loss": [4.0, 3.0, 2.0]},
                         {"lm loss": (ExactCheck(), ApproximateCheck(rtol=1e-6, max_misses=0))})
"""


def _run(demo, *extra):
    return main(
        [
            "run",
            "demo",
            "--suites-dir",
            str(demo.path / "suites"),
            "--out",
            str(demo.path / "out"),
            "--hw",
            HW,
            *extra,
        ]
    )


class TestRun:
    def test_end_to_end(self, demo, capsys):
        """Golden written, then `run` passes with JUnit XML, report.md, a summary table and PNGs."""
        assert 0 == _run(demo, "--pytest-args", f"{FAST} --update-golden=all")
        assert 0 == _run(demo, "--pytest-args", FAST)
        out = capsys.readouterr().out
        assert "demo   tiny_mhc  lm loss" in out and "PASS" in out
        junit = ET.parse(demo.path / "out" / "junit-demo.xml").getroot()
        assert "3" == junit.find("testsuite").get("tests")
        report = (demo.path / "out" / "report.md").read_text()
        assert "| demo | tiny_mhc | lm loss | exact | pass |" in report
        assert (demo.path / "out" / "plots" / "demo__tiny_mhc.png").read_bytes().startswith(b"\x89PNG")
        assert (demo.path / "out" / "plots" / "demo__tiny__vs__tiny_mhc__lm_loss.png").is_file()
        assert "](plots/demo__tiny__vs__tiny_mhc__lm_loss.png)" in report

    def test_golden_mismatch_exits_nonzero(self, demo, monkeypatch, capsys):
        """A perturbed case makes `run` exit 1 and the report carries the numbers."""
        assert 0 == _run(demo, "--no-plots", "--pytest-args", f"{FAST} --update-golden=all")
        monkeypatch.setenv("DEMO_SCALE", "1.5")
        assert 1 == _run(demo, "--no-plots", "--pytest-args", FAST)
        assert "FAIL" in capsys.readouterr().out
        report = (demo.path / "out" / "report.md").read_text()
        assert "| demo | tiny_mhc | lm loss | exact | fail | +5.000e-01 rel @ step 8 |" in report
        assert "step 8: actual 14.475, golden 9.65" in report

    def test_progress_lines_and_suite_args(self, demo, capsys):
        """`run` prints a progress line per suite (done / total, failures, elapsed), each failure as it
        happens, and passes --suite-args to that suite only."""
        assert 0 == _run(demo, "--no-plots", "--pytest-args", f"{FAST} --update-golden=all")
        out = capsys.readouterr().out
        assert "[demo] done: 3/3 tests, 0 failed, 0 skipped, " in out
        assert 1 == _run(
            demo, "--no-plots", "--suite-args", "demo=-k tiny_mhc", "--pytest-args", f"{FAST} --hw=bad/"
        )
        out = capsys.readouterr().out
        assert "[demo] FAILED " in out and "[demo] done: 1/1 tests, 1 failed" in out
        assert (demo.path / "out" / "pytest-demo.log").is_file()
        assert 2 == _run(demo, "--suite-args", "unit=-n 2")
        assert "suite arguments for ['unit'], which this run does not run" in capsys.readouterr().err

    def test_the_lane_that_decided_is_reported(self, demo, capsys, monkeypatch):
        """Recorded under one fingerprint and run under another (an ISA pin): the exact lane is n/a in the
        summary, the report and JUnit, the approximate lane decides; --exact-only then enforces it here."""
        (demo.path / "suites" / "demo" / "test_lanes.py").write_text(LANES_CASE, encoding="utf-8")
        monkeypatch.delenv("MKL_CBWR", raising=False)
        assert 0 == _run(demo, "--no-plots", "--pytest-args", f"{FAST} --update-golden=all")
        monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # another numerics fingerprint for the same machine
        assert 1 == _run(demo, "--no-plots", "--pytest-args", FAST)
        out = capsys.readouterr().out
        assert "demo/tiny_lanes: decided by the approximate lane; exact: n/a, recorded on " in out
        assert "lm loss: no lane decides: its only check is exact, n/a on this machine" in out  # case tiny
        row = "| demo | tiny_lanes | lm loss | exact | n/a | - |"
        report = (demo.path / "out" / "report.md").read_text()
        assert row in report and "| demo | tiny_lanes | approximate | exact: n/a, recorded on " in report
        case = next(
            c
            for c in ET.parse(demo.path / "out" / "junit-demo.xml").getroot().iter("testcase")
            if c.get("name") == "test_lanes"
        )
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert props["golden_lane"] == "approximate" and props["golden_exact"].startswith("exact: n/a")
        assert f"; this machine {props['numerics_fingerprint']}" in props["golden_exact"]
        assert 0 == main(
            [
                "recalibrate",
                "demo",
                "tiny_lanes",
                "--exact-only",
                "--repeats",
                "2",
                "--hw",
                HW,
                "--suites-dir",
                str(demo.path / "suites"),
                "--pytest-args",
                FAST,
            ]
        )
        assert 1 == _run(demo, "--no-plots", "--pytest-args", FAST)
        assert (
            "demo/tiny_lanes: decided by the exact lane; exact: enforced, exact values of this fingerprint"
            in capsys.readouterr().out
        )

    def test_unknown_suite_lists_valid(self, demo, capsys):
        """An unknown suite name is a usage error that lists the valid suites."""
        assert 2 == main(["run", "nope", "--suites-dir", str(demo.path / "suites")])
        assert "unknown suite(s) ['nope']" in capsys.readouterr().err

    def test_run_outside_a_checkout_says_so(self, tmp_path, capsys):
        """Without a suites directory (an installed harness, run elsewhere) `run` says it needs a checkout."""
        assert 2 == main(["run", "unit", "--suites-dir", str(tmp_path / "suites")])
        err = capsys.readouterr().err
        assert f"no suites directory {tmp_path / 'suites'}" in err and "checkout of mhc-suite" in err


class TestDiff:
    def test_reports_change_and_one_sided_steps(self, tmp_path, capsys):
        """diff prints the signed mean relative change, max abs diff and steps on one side only."""
        a = tmp_path / "a.json"
        b = tmp_path / "b.json"
        a.write_text(dumps_golden({"lm loss": series_from_list([10.0, 10.0, 10.0])}))
        b.write_text(
            dumps_golden({"lm loss": series_from_list([9.0, 9.0]), "num-zeros": series_from_list([1.0])})
        )
        assert 1 == main(["diff", str(a), str(b)])
        out = capsys.readouterr().out
        assert (
            "lm loss: mean((A-B)/A) = +1.000000e-01, max |A-B| = 1, max |A-B|/|A| = 1.000e-01 at step 1"
            in out
        )
        assert "over 2 common steps; 2 step(s) outside the default band" in out
        assert "steps only in A: [3]" in out and "num-zeros: only in B" in out

    def test_names_the_worst_metric_and_step(self, tmp_path, capsys):
        """diff names the metric and step of the largest relative difference, and counts the steps outside
        the default bands (harness.golden.bands)."""
        a, b = tmp_path / "a.json", tmp_path / "b.json"
        loss = [5.0, 4.0, 3.0, 2.0]
        a.write_text(
            dumps_golden({"lm loss": series_from_list(loss), "grad-norm": series_from_list([1.0] * 4)})
        )
        shifted = list(loss)
        shifted[2] *= 1 + 1e-3
        b.write_text(
            dumps_golden(
                {
                    "lm loss": series_from_list(shifted),
                    "grad-norm": series_from_list([1.0, 1.0, 1.0, 1.0 + 1e-9]),
                }
            )
        )
        assert 1 == main(["diff", str(a), str(b)])
        out = capsys.readouterr().out
        assert "worst: 'lm loss' at step 3 (|A-B|/|A| = 1.000e-03)" in out
        assert "grad-norm: " in out and "at step 4" in out
        assert "1 step(s) outside the default bands" in out

    def test_identical(self, data_dir, capsys):
        """A file diffed with itself is identical (exit 0)."""
        f = str(data_dir / "golden_values_dev_dgx_h100.json")
        assert 0 == main(["diff", f, f])
        assert "identical values" in capsys.readouterr().out

    def test_malformed_input(self, tmp_path, capsys):
        """A malformed file is named with its position; exit 1."""
        (tmp_path / "a.json").write_text("{\n  oops")
        assert 1 == main(["diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")])
        assert "a.json: malformed JSON at line 2 column 3" in capsys.readouterr().err


class TestImport:
    def test_import_legacy_megatron_file(self, data_dir, tmp_path, capsys):
        """import-megatron drops legacy "nan" steps and writes a clean case with meta."""
        assert 0 == main(
            [
                "import-megatron",
                str(data_dir / "golden_values_legacy_nan.json"),
                "functional",
                "gpt_mhc",
                "--hw",
                "dgx_h100",
                "--golden-dir",
                str(tmp_path),
            ]
        )
        g = load_golden(tmp_path / "dgx_h100" / "functional" / "gpt_mhc.json")
        assert 2 == g["iteration-time"].steps[0]
        meta = json.loads((tmp_path / "dgx_h100" / "functional" / "gpt_mhc.meta.json").read_text())
        assert meta["source"] == "import-megatron golden_values_legacy_nan.json"
        assert "iteration-time: 49 steps" in capsys.readouterr().out

    def test_import_records_the_upstream_provenance(self, data_dir, tmp_path):
        """The meta names the upstream file, its sha256 and the upstream commit given."""
        src = data_dir / "golden_values_legacy_nan.json"
        assert 0 == main(
            [
                "import-megatron",
                str(src),
                "functional",
                "gpt_mhc",
                "--hw",
                "dgx_h100",
                "--golden-dir",
                str(tmp_path),
                "--upstream-commit",
                "d48bd6be",
                "--upstream-path",
                "tests/x/golden.json",
            ]
        )
        meta = json.loads((tmp_path / "dgx_h100" / "functional" / "gpt_mhc.meta.json").read_text())
        assert meta["imported"] == {
            "file": "tests/x/golden.json",
            "upstream_commit": "d48bd6be",
            "file_sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
        }

    def test_import_says_what_it_drops_and_replaces(self, data_dir, tmp_path, capsys):
        """import-megatron counts the 'nan' steps it drops and shows the change when it replaces a case."""
        argv = [
            "import-megatron",
            str(data_dir / "golden_values_legacy_nan.json"),
            "functional",
            "gpt_mhc",
            "--hw",
            "dgx_h100",
            "--golden-dir",
            str(tmp_path),
        ]
        assert 0 == main(argv)
        out = capsys.readouterr().out
        assert "dropped 1 'nan' step(s)" in out and "replacing" not in out, out
        assert 0 == main(argv)
        out = capsys.readouterr().out
        assert (
            "replacing the existing functional/gpt_mhc on dgx_h100:" in out
            and "max |old-new| = 0 over 50 steps" in out
        ), out


class TestArgumentErrors:
    def test_bad_pytest_args_and_timeout_are_usage_errors(self, demo, capsys):
        """An unbalanced quote in --pytest-args names the option; a timeout <= 0 is refused by argparse."""
        assert 2 == main(["run", "demo", "--suites-dir", str(demo.path / "suites"), "--pytest-args", '"-k'])
        assert "--pytest-args '\"-k': No closing quotation" in capsys.readouterr().err
        with pytest.raises(SystemExit) as exc:
            main(["run", "demo", "--timeout", "-5"])
        assert (
            exc.value.code == 2 and "'-5': must be a finite number of seconds > 0" in capsys.readouterr().err
        )

    def test_schema_errors_list_only_what_is_wrong(self, tmp_path, capsys):
        """An extra key is named without an empty 'missing' list; a non-ASCII digit is not a step."""
        bad = tmp_path / "a.json"
        bad.write_text(
            json.dumps(
                {
                    "lm loss": {
                        "start_step": 1,
                        "end_step": 1,
                        "step_interval": 1,
                        "values": {"1": 1.0},
                        "extra": 0,
                    }
                }
            )
        )
        assert 1 == main(["diff", str(bad), str(bad)])
        err = capsys.readouterr().err
        assert "unexpected keys ['extra']" in err and "missing keys" not in err
        bad.write_text(
            json.dumps(
                {"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"\uff11": 1.0}}}
            )
        )
        assert 1 == main(["diff", str(bad), str(bad)])
        assert "step key '\uff11' is not a non-negative integer" in capsys.readouterr().err
