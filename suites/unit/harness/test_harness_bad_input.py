"""Bad input through the fixture logic: a clear message naming file and numbers, and nothing written."""

from __future__ import annotations

import json

import pytest

from harness.golden.case_check import GoldenSettings, check_case
from harness.golden.compare import ApproximateCheck, ExactCheck
from harness.golden.fingerprint import current_fingerprint
from harness.golden.hardware import HardwareKey
from harness.golden.schema import series_from_list
from harness.golden.store import GoldenStore, build_meta

HW = "cpu_x86_64"
LOSS = [10.0, 9.0, 8.0, 7.0]
CHECKS = {"lm loss": ExactCheck()}


@pytest.fixture
def golden_dir(tmp_path):
    """A store holding s/c with LOSS on cpu_x86_64 and on dgx_h100."""
    store = GoldenStore(tmp_path / "golden")
    g = {"lm loss": series_from_list(LOSS)}
    for hw in (HW, "dgx_h100"):  # recorded by this process's fingerprint: the exact lane applies here
        store.write(
            hw,
            "s",
            "c",
            g,
            build_meta(hw=hw, suite="s", case="c", golden=g, source="test", numerics=current_fingerprint()),
        )
    return tmp_path / "golden"


def _check(golden_dir, metrics, checks=CHECKS, *, hw=HW, update=None, case="c"):
    settings = GoldenSettings(
        golden_dir=golden_dir, hw=HardwareKey(key=hw, rule="test", source="option"), update=update
    )
    return check_case(settings, suite="s", case=case, metrics=metrics, checks=checks)


def _case_file(golden_dir, name="c.json"):
    return golden_dir / HW / "s" / name


class TestBadInput:
    def test_malformed_golden(self, golden_dir, tree):
        """Malformed golden JSON: error names the file and line/column; --update-golden=failed writes nothing."""
        _case_file(golden_dir).write_text('{"lm loss": {"start_step": 1,\n  "end_step": }', encoding="utf-8")
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": LOSS}, update="failed")
        assert "error" == o.status
        assert f"{_case_file(golden_dir)}: malformed JSON at line 2 column 15" in o.message
        assert before == tree(golden_dir)

    def test_metric_missing_from_actual(self, golden_dir, tree):
        """A checked metric the test did not hand over is named."""
        before = tree(golden_dir)
        o = _check(golden_dir, {"num-zeros": [1.0] * 4}, {"lm loss": ExactCheck()})
        assert "fail" == o.status and "metric 'lm loss' is missing from the actual values" in o.message
        assert before == tree(golden_dir)

    def test_metric_missing_from_golden(self, golden_dir, tree):
        """A checked metric absent from the golden file is named, with the file."""
        before = tree(golden_dir)
        o = _check(
            golden_dir,
            {"lm loss": LOSS, "num-zeros": [1.0] * 4},
            {"lm loss": ExactCheck(), "num-zeros": ApproximateCheck(rtol=0.2)},
        )
        assert f"metric 'num-zeros' is missing from golden file {_case_file(golden_dir)}" in o.message
        assert before == tree(golden_dir)

    def test_steps_misaligned(self, golden_dir, tree):
        """Misaligned steps are listed per side."""
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": {1: 10.0, 2: 9.0, 3: 8.0, 5: 6.0}})
        assert "steps only in golden: 4; steps only in actual: 5" in o.message
        assert before == tree(golden_dir)

    def test_nan_in_golden_file(self, golden_dir, tree):
        """NaN in a golden file is rejected on read, naming file, metric and step."""
        doc = json.loads(_case_file(golden_dir).read_text())
        doc["lm loss"]["values"]["3"] = "nan"
        _case_file(golden_dir).write_text(json.dumps(doc), encoding="utf-8")
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": LOSS})
        assert "error" == o.status and f"{_case_file(golden_dir)}: metric 'lm loss' step 3" in o.message
        assert before == tree(golden_dir)

    def test_nan_in_actual_never_written(self, golden_dir, tree):
        """Non-finite actual values are refused even with --update-golden=all."""
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": [10.0, float("inf"), 8.0, 7.0]}, update="all")
        assert "error" == o.status and "metric 'lm loss' step 2: value inf is not finite" in o.message
        assert before == tree(golden_dir)

    def test_missing_golden_for_hardware(self, golden_dir, tree):
        """No file for this key: the message lists existing keys and the exact recalibrate command."""
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": LOSS}, hw="h200")
        assert "error" == o.status
        assert "Hardware keys with this case: cpu_x86_64, dgx_h100" in o.message
        assert "mhc-harness recalibrate s c --hw h200 --repeats 5" in o.message
        assert before == tree(golden_dir)

    def test_corrupt_meta(self, golden_dir, tree):
        """A corrupt meta file is an error naming it; the golden pair is left alone."""
        _case_file(golden_dir, "c.meta.json").write_text("{not json", encoding="utf-8")
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": LOSS}, update="failed")
        assert "error" == o.status and "c.meta.json: malformed JSON at line 1 column 2" in o.message
        assert before == tree(golden_dir)

    def test_partial_meta(self, golden_dir, tree):
        """A truncated (empty) meta file is reported as partial."""
        _case_file(golden_dir, "c.meta.json").write_text("", encoding="utf-8")
        before = tree(golden_dir)
        o = _check(golden_dir, {"lm loss": LOSS})
        assert "error" == o.status and "empty meta file (partial write?)" in o.message
        assert before == tree(golden_dir)

    def test_bad_check_names_metric(self, golden_dir, tree):
        """A tolerance given as a bare number is refused, naming the metric."""
        before = tree(golden_dir)
        with pytest.raises(ValueError, match=r"checks\['lm loss'\]=0\.05"):
            _check(golden_dir, {"lm loss": LOSS}, {"lm loss": 0.05})
        assert before == tree(golden_dir)
