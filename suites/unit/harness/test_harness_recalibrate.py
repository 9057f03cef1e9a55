"""Recalibration: programmatic runner semantics, refusals, and the CLI driving real pytest runs."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.golden.compare import ExactCheck
from harness.golden.errors import NonFiniteError, RecalibrationError, UnknownHardwareError
from harness.golden.recalibrate import Repeat, mean_relative_change, recalibrate
from harness.golden.schema import series_from_list
from harness.golden.store import GoldenStore

HW = "cpu_x86_64"


def _run(store, values_per_repeat, *, lines=None, **kw):
    """Recalibrate s/c with one list of lm-loss values per repeat."""
    kw.setdefault("repeats", len(values_per_repeat))
    return recalibrate(
        store=store,
        hw=HW,
        suite="s",
        case="c",
        runner=lambda i: {"lm loss": values_per_repeat[i]},
        out=(lines.append if lines is not None else lambda s: None),
        **kw,
    )


class TestProgrammatic:
    def test_writes_mean_and_spread(self, tmp_path):
        """The golden file holds the per-step mean and the meta the spread and repeat count."""
        store = GoldenStore(tmp_path)
        _run(store, [[1.0, 2.0], [3.0, 4.0]])
        golden, meta = store.load(HW, "s", "c")
        assert {1: 2.0, 2: 3.0} == dict(golden["lm loss"].values)
        assert 2 == meta["repeats"]
        assert {"min": 1.0, "max": 3.0} == {
            k: meta["spread"]["lm loss"]["steps"]["1"][k] for k in ("min", "max")
        }
        assert "mhc-harness recalibrate" == meta["source"]

    def test_identical_repeats_stay_bit_exact(self, tmp_path):
        """Identical repeats keep their exact value (no mean rounding), so the exact lane still passes."""
        x = 0.1 + 0.2
        store = GoldenStore(tmp_path)
        _run(store, [[x, 1 / 3]] * 3)
        assert [x, 1 / 3] == list(store.load(HW, "s", "c")[0]["lm loss"].values.values())

    def test_prints_change_before_writing(self, tmp_path):
        """The signed mean relative change against the old file is printed before the write."""
        store = GoldenStore(tmp_path)
        _run(store, [[10.0, 20.0]])
        lines: list[str] = []
        _run(store, [[9.0, 18.0]], lines=lines)
        change = next(i for i, s in enumerate(lines) if "mean((old-new)/old) = +1.000000e-01" in s)
        wrote = next(i for i, s in enumerate(lines) if s.startswith("[s/c on cpu_x86_64] wrote"))
        assert change < wrote

    def test_mean_relative_change_sign(self):
        """mean((old-new)/old) is positive when the new values are lower; old == 0 steps are skipped."""
        mr, mx, n = mean_relative_change(series_from_list([10.0, 0.0]), series_from_list([9.0, 1.0]))
        assert (0.1, 1.0, 2) == (pytest.approx(mr), mx, n)

    def test_refuses_nonfinite(self, tmp_path, tree):
        """A repeat with NaN is refused and nothing is written."""
        with pytest.raises(NonFiniteError, match=r"repeat 2: metric 'lm loss' step 1.*nothing written"):
            _run(GoldenStore(tmp_path), [[1.0], [float("nan")]])
        assert {} == tree(tmp_path)

    def test_refuses_failed_run(self, tmp_path, tree):
        """A runner that fails aborts the recalibration; nothing is written."""

        def runner(i):
            raise RecalibrationError("repeat 1: the run failed")

        with pytest.raises(RecalibrationError, match="the run failed"):
            recalibrate(
                store=GoldenStore(tmp_path),
                hw=HW,
                suite="s",
                case="c",
                runner=runner,
                repeats=2,
                out=lambda s: None,
            )
        assert {} == tree(tmp_path)

    def test_refuses_unknown_hw_before_running(self, tmp_path, tree):
        """An unknown hardware key is refused before the first repeat runs."""
        calls: list[int] = []

        def runner(i):
            calls.append(i)
            return {"m": [1.0]}

        with pytest.raises(UnknownHardwareError, match="gpu_foo_x1"):
            recalibrate(
                store=GoldenStore(tmp_path),
                hw="gpu_foo_x1",
                suite="s",
                case="c",
                repeats=1,
                runner=runner,
                out=lambda s: None,
            )
        assert ([], {}) == (calls, tree(tmp_path))

    def test_refuses_an_unwritable_golden_dir_before_running(self, tmp_path):
        """A golden dir that cannot be created (a file is in its way) is refused before the first repeat runs."""
        from harness.golden.errors import GoldenFormatError

        (tmp_path / "store").write_text("a file, not a directory")
        calls: list[int] = []

        def runner(i):
            calls.append(i)
            return {"lm loss": [1.0]}

        with pytest.raises(GoldenFormatError, match=r"store: not a writable directory.*nothing was run"):
            recalibrate(
                store=GoldenStore(tmp_path / "store"),
                hw=HW,
                suite="s",
                case="c",
                repeats=2,
                runner=runner,
                out=lambda s: None,
            )
        assert calls == []

    def test_allow_unknown_hw(self, tmp_path):
        """allow_unknown_hw lets an unknown key through."""
        r = recalibrate(
            store=GoldenStore(tmp_path),
            hw="gpu_foo_x1",
            suite="s",
            case="c",
            repeats=1,
            runner=lambda i: {"m": [1.0]},
            allow_unknown_hw=True,
            out=lambda s: None,
        )
        assert r.written

    def test_misaligned_repeats_refused(self, tmp_path, tree):
        """Repeats with different steps are refused, naming the steps."""
        with pytest.raises(
            RecalibrationError, match=r"steps differ between repeat 1 and repeat 2: only in 1: \[3\]"
        ):
            _run(GoldenStore(tmp_path), [[1.0, 2.0, 3.0], [1.0, 2.0]])
        assert {} == tree(tmp_path)

    def test_only_failing_keeps_passing_golden(self, tmp_path):
        """--only-failing leaves a golden file that still passes untouched."""
        store = GoldenStore(tmp_path)
        _run(store, [[1.0, 2.0]])
        before = store.files(HW, "s", "c").json.read_bytes()
        r = _run(store, [[1.0, 2.0]], only_failing=True, checks={"lm loss": ExactCheck()})
        assert not r.written and before == store.files(HW, "s", "c").json.read_bytes()

    def test_only_failing_rewrites_failing_golden(self, tmp_path):
        """--only-failing rewrites a golden file that fails a repeat."""
        store = GoldenStore(tmp_path)
        _run(store, [[1.0, 2.0]])
        assert _run(store, [[1.0, 2.5]], only_failing=True, checks={"lm loss": ExactCheck()}).written

    def test_only_failing_uses_runner_verdict(self, tmp_path):
        """A runner reporting golden_passed decides --only-failing without checks."""
        store = GoldenStore(tmp_path)
        _run(store, [[1.0]])
        r = recalibrate(
            store=store,
            hw=HW,
            suite="s",
            case="c",
            repeats=1,
            only_failing=True,
            out=lambda s: None,
            runner=lambda i: Repeat(metrics={"lm loss": [5.0]}, golden_passed=True),
        )
        assert not r.written

    def test_dry_run_writes_nothing(self, tmp_path, tree):
        """dry_run prints the changes and writes nothing."""
        assert not _run(GoldenStore(tmp_path), [[1.0]], dry_run=True).written
        assert {} == tree(tmp_path)


class TestCli:
    def _cli(self, demo, *extra):
        return main(
            [
                "recalibrate",
                "demo",
                "tiny_mhc",
                "--suites-dir",
                str(demo.path / "suites"),
                "--hw",
                HW,
                "--pytest-args",
                "-p no:hypothesispytest -p no:benchmark",
                *extra,
            ]
        )

    def test_recalibrate_runs_pytest(self, demo, capsys):
        """The CLI runs the case N times through pytest and writes golden and meta."""
        assert 0 == self._cli(demo, "--repeats", "2")
        out = capsys.readouterr().out
        assert "repeat 2/2" in out and "lm loss: new (50 steps" in out
        meta = json.loads((demo.path / "golden" / HW / "demo" / "tiny_mhc.meta.json").read_text())
        assert (2, HW) == (meta["repeats"], meta["hardware"])
        assert not (demo.path / "golden" / HW / "demo" / "tiny.json").exists()

    def test_only_failing_cli(self, demo, capsys):
        """With --only-failing a passing golden file is left alone."""
        assert 0 == self._cli(demo, "--repeats", "1")
        assert 0 == self._cli(demo, "--repeats", "1", "--only-failing")
        assert "not rewritten (--only-failing)" in capsys.readouterr().out

    def test_failed_run_refused(self, demo, capsys, monkeypatch, tree):
        """A crashing case makes the CLI exit 1 and write nothing."""
        monkeypatch.setenv("DEMO_FAIL", "1")
        assert 1 == self._cli(demo, "--repeats", "2")
        assert "repeat 1: the run failed (pytest exit 1)" in capsys.readouterr().err
        assert {} == tree(demo.path / "golden")

    def test_unknown_hw_refused(self, demo, capsys, tree):
        """An unknown --hw is refused before anything runs."""
        assert 1 == main(
            ["recalibrate", "demo", "tiny", "--suites-dir", str(demo.path / "suites"), "--hw", "gpu_foo_x1"]
        )
        assert "not a known key" in capsys.readouterr().err
        assert {} == tree(demo.path / "golden")

    def test_unknown_case_says_no_test_runs_it(self, demo, capsys, tree):
        """A case no test of the suite runs is named as such (pytest exit 5), not as a failed run."""
        assert 1 == main(
            [
                "recalibrate",
                "demo",
                "nocase",
                "--suites-dir",
                str(demo.path / "suites"),
                "--hw",
                HW,
                "--pytest-args",
                "-p no:hypothesispytest -p no:benchmark",
                "--repeats",
                "1",
            ]
        )
        assert (
            "runs case 'nocase' (pytest exit 5: nothing collected or all deselected)"
            in capsys.readouterr().err
        )
        assert {} == tree(demo.path / "golden")
