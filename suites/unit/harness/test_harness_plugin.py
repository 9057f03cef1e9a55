"""The pytest plugin end to end with pytester: write, pass, perturb, regenerate, select, record."""

from __future__ import annotations

import json

HW = "cpu_x86_64"


def _golden(pytester, case="tiny_mhc", hw=HW):
    return pytester.path / "golden" / hw / "demo" / f"{case}.json"


class TestWorkflow:
    def test_update_all_writes_and_passes(self, run_inline, demo):
        """--update-golden=all writes golden/<hw>/demo/<case>.json and passes."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}").assert_outcomes(passed=3)
        doc = json.loads(_golden(demo).read_text())
        assert ["lm loss", "iteration-time"] == list(doc)
        assert _golden(demo).with_name("tiny_mhc.meta.json").is_file()

    def test_rerun_passes(self, run_inline, demo):
        """After writing, a plain rerun passes."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}")
        run_inline(demo, f"--hw={HW}").assert_outcomes(passed=3)

    def test_perturbed_metric_fails_with_numbers(self, run_inline, demo, monkeypatch):
        """A perturbed step fails and the report shows step, actual, golden, delta and band."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}")
        monkeypatch.setenv("DEMO_SCALE", "1.5")
        r = run_inline(demo, f"--hw={HW}")
        r.assert_outcomes(passed=2, failed=1)
        out = r.stdout.str()
        assert "lm loss [exact]: 1 of 50 steps differ, allowed 0" in out
        assert "step 8: actual 14.475, golden 9.65, delta +4.825 (rel +5.000e-01), band delta == 0" in out

    def test_update_failed_rewrites_and_still_fails(self, run_inline, demo, monkeypatch):
        """--update-golden=failed rewrites only the failing file, fails, and the next run passes."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}")
        untouched = _golden(demo, "tiny").read_bytes()
        monkeypatch.setenv("DEMO_SCALE", "1.5")
        r = run_inline(demo, "--update-golden=failed", f"--hw={HW}")
        r.assert_outcomes(passed=2, failed=1)
        r.stdout.fnmatch_lines(["*rewrote*tiny_mhc.json (--update-golden=failed)*"])
        assert untouched == _golden(demo, "tiny").read_bytes()
        run_inline(demo, f"--hw={HW}").assert_outcomes(passed=3)

    def test_missing_golden_fails_with_command(self, run_inline, demo):
        """Without a golden file the test fails with the recalibrate command for this hardware."""
        r = run_inline(demo, f"--hw={HW}", "-k", "tiny_mhc")
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines([f"*mhc-harness recalibrate demo tiny_mhc --hw {HW} --repeats 5*"])
        assert not (demo.path / "golden").exists()


class TestOptions:
    def test_options_in_help(self, run_inline, demo):
        """The option group lists --hw, --golden-dir, --update-golden and --mhc-results-dir."""
        run_inline(demo, "--help").stdout.fnmatch_lines(
            [
                "*mHC golden values*",
                "*--hw=HW*",
                "*--golden-dir=GOLDEN_DIR*",
                "*--update-golden=*",
                "*--mhc-results-dir=*",
            ]
        )

    def test_env_hw(self, run_inline, demo, monkeypatch):
        """MHC_HW picks the golden directory when --hw is not given."""
        monkeypatch.setenv("MHC_HW", "h200")
        run_inline(demo, "--update-golden=all").assert_outcomes(passed=3)
        assert _golden(demo, hw="h200").is_file()

    def test_golden_dir_option(self, run_inline, demo, tmp_path):
        """--golden-dir moves the store."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}", f"--golden-dir={tmp_path / 'g'}")
        assert (tmp_path / "g" / HW / "demo" / "tiny.json").is_file()

    def test_results_dir(self, run_inline, demo, tmp_path):
        """--mhc-results-dir receives each case's actual values and outcome."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}")
        run_inline(demo, f"--hw={HW}", f"--mhc-results-dir={tmp_path / 'res'}").assert_outcomes(passed=3)
        outcome = json.loads((tmp_path / "res" / "demo" / "tiny_mhc.result.json").read_text())
        assert ("pass", HW) == (outcome["status"], outcome["hw"])
        assert {"lm loss", "iteration-time"} == set(
            json.loads((tmp_path / "res" / "demo" / "tiny_mhc.json").read_text())
        )

    def test_case_selection(self, run_inline, demo):
        """--mhc-case runs only tests whose golden_case marker names the case."""
        r = run_inline(demo, "--update-golden=all", f"--hw={HW}", "--mhc-case=tiny")
        r.assert_outcomes(passed=1, deselected=2)
        assert not _golden(demo).exists()

    def test_record_only_never_fails(self, run_inline, demo, monkeypatch, tmp_path):
        """--mhc-record-only records a mismatch without failing and without writing golden files."""
        run_inline(demo, "--update-golden=all", f"--hw={HW}")
        before = _golden(demo).read_bytes()
        monkeypatch.setenv("DEMO_SCALE", "1.5")
        run_inline(demo, f"--hw={HW}", "--mhc-record-only", f"--mhc-results-dir={tmp_path}").assert_outcomes(
            passed=3
        )
        assert before == _golden(demo).read_bytes()
        assert json.loads((tmp_path / "demo" / "tiny_mhc.result.json").read_text())["golden_passed"] is False


class TestFixtureErrors:
    def test_suite_outside_suites_dir(self, run_inline, pytester):
        """A test outside suites/<suite>/ must pass suite=; the failure says so."""
        pytester.makeini("[pytest]\n")
        pytester.makepyfile(
            test_x="def test_x(golden_metrics):\n"
            "    from harness import ExactCheck\n"
            "    golden_metrics.check('c', {'m': [1.0]}, {'m': ExactCheck()})\n"
        )
        r = run_inline(pytester, f"--hw={HW}")
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines(["*cannot derive the suite*pass suite= to golden_metrics.check*"])

    def test_explicit_suite(self, run_inline, pytester):
        """suite= overrides the path-derived suite."""
        pytester.makeini("[pytest]\n")
        pytester.makepyfile(
            test_x="def test_x(golden_metrics):\n"
            "    from harness import ExactCheck\n"
            "    golden_metrics.check('c', {'m': [1.0]}, {'m': ExactCheck()}, suite='mine')\n"
        )
        run_inline(pytester, f"--hw={HW}", "--update-golden=all").assert_outcomes(passed=1)
        assert (pytester.path / "golden" / HW / "mine" / "c.json").is_file()

    def test_duplicate_case_names(self, run_inline, demo):
        """Two tests handing the same case fail the second, naming the first."""
        (demo.path / "suites" / "demo" / "test_dup.py").write_text(
            "from harness import ExactCheck\n"
            "def test_dup(golden_metrics):\n"
            "    golden_metrics.check('tiny', {'m': [1.0]}, {'m': ExactCheck()})\n",
            encoding="utf-8",
        )
        r = run_inline(demo, "--update-golden=all", f"--hw={HW}")
        r.assert_outcomes(passed=3, failed=1)
        r.stdout.fnmatch_lines(["*case demo/tiny was already checked by*test_demo.py::test_tiny*"])

    def test_marker_mismatch(self, run_inline, demo):
        """A case not named by the test's golden_case marker is refused."""
        (demo.path / "suites" / "demo" / "test_mark.py").write_text(
            "import pytest\nfrom harness import ExactCheck\n"
            "@pytest.mark.golden_case('a')\n"
            "def test_m(golden_metrics):\n"
            "    golden_metrics.check('b', {'m': [1.0]}, {'m': ExactCheck()})\n",
            encoding="utf-8",
        )
        r = run_inline(demo, "--update-golden=all", f"--hw={HW}", "suites/demo/test_mark.py")
        r.assert_outcomes(failed=1)
        assert "case 'b' is not among its golden_case marker names ['a']" in r.stdout.str()
