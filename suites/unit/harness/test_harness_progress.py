"""Progress of a pytest run: the plugin's file (also under xdist) and the lines `run` prints from it."""

from __future__ import annotations

import json

from harness.progress import ProgressPrinter, ProgressWriter, read_progress


def test_writer_counts_done_failed_and_skipped(tmp_path):
    """A test is done at its teardown report; a failure in any phase counts once, with its phase."""
    w = ProgressWriter(tmp_path / "p.json")
    w.collected(3)
    for nodeid, outcomes in (
        ("a", ("passed", "passed", "passed")),
        ("b", ("passed", "failed", "failed")),
        ("c", ("skipped", None, "passed")),
    ):
        for when, outcome in zip(("setup", "call", "teardown"), outcomes, strict=True):
            if outcome:
                w.report(nodeid, when, outcome)
    w.finish()
    p = read_progress(tmp_path / "p.json")
    assert (p.total, p.done, p.failed, p.skipped, p.finished) == (3, 3, 1, 1, True)
    assert p.failures == ["b (call)"]


def test_printer_prints_failures_at_once_and_counts_when_they_move(tmp_path):
    """Each failure is printed as soon as it is seen; the count line when it moved (and at the end)."""
    lines: list[str] = []
    path = tmp_path / "p.json"
    printer = ProgressPrinter("unit", path, out=lines.append, every_s=0.0, heartbeat_s=1e9)
    printer.poll()
    assert lines == ["[unit] collecting ... 0 s"]
    path.write_text(
        json.dumps(
            {"total": 5, "done": 2, "failed": 1, "skipped": 0, "failures": ["t::x (call)"], "finished": False}
        )
    )
    printer.poll()
    printer.poll()  # nothing moved: nothing printed
    assert lines[1:] == ["[unit] FAILED t::x (call)", "[unit] 2/5 tests, 1 failed, 0 skipped, 0 s"]
    printer.poll(final=True)
    assert lines[-1] == "[unit] done: 2/5 tests, 1 failed, 0 skipped, 0 s"


def test_plugin_writes_progress_under_xdist(pytester):
    """Under xdist the controller counts its workers' reports: total, done and failures come out right."""
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(
        test_p="def test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
        "import pytest\n@pytest.mark.skip(reason='x')\ndef test_skip():\n    pass\n"
    )
    path = pytester.path / "progress.json"
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", f"--mhc-progress-file={path}")
    r.assert_outcomes(passed=1, failed=1, skipped=1)
    p = read_progress(path)
    assert (p.total, p.done, p.failed, p.skipped, p.finished) == (3, 3, 1, 1, True)
    assert len(p.failures) == 1 and p.failures[0].endswith("test_p.py::test_bad (call)")
