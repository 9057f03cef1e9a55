"""The golden store: layout, atomic locked writes, concurrent and killed writers, meta checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from harness.golden.errors import MetaError, MissingGoldenError, NonFiniteError
from harness.golden.schema import series_from_list
from harness.golden.store import PAUSE_ENV_VAR, GoldenStore, build_meta

HW = "cpu_x86_64"

WRITER = """
import sys, time
from harness.golden.recalibrate import recalibrate
from harness.golden.store import GoldenStore
root, value, repeats, start = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
time.sleep(max(0.0, start - time.time()))
recalibrate(store=GoldenStore(root), hw="cpu_x86_64", suite="s", case="c", repeats=repeats,
            runner=lambda i: {"lm loss": [value] * 2000, "num-zeros": [2 * value] * 2000}, out=lambda s: None)
"""


def _golden(v: float, n: int = 3):
    return {"lm loss": series_from_list([v] * n)}


def _write(store: GoldenStore, v: float, hw: str = HW, case: str = "c"):
    g = _golden(v)
    return store.write(hw, "s", case, g, build_meta(hw=hw, suite="s", case=case, golden=g, source="test"))


class TestLayout:
    def test_paths(self, tmp_path):
        """Golden values live at <root>/<hw>/<suite>/<case>.json with a .meta.json sidecar."""
        f = _write(GoldenStore(tmp_path), 1.0)
        assert tmp_path / HW / "s" / "c.json" == f.json
        assert (tmp_path / HW / "s" / "c.meta.json").is_file()

    def test_meta_provenance(self, tmp_path):
        """The meta sidecar records hardware, versions, commit, date, repeats and the content digest."""
        store = GoldenStore(tmp_path)
        _write(store, 1.0)
        _, meta = store.load(HW, "s", "c")
        assert {"hardware", "versions", "git_commit", "date", "repeats", "spread", "golden_sha256"} <= set(
            meta
        )
        assert "torch" in meta["versions"] and "cuda" in meta["versions"]

    def test_meta_commit_from_env(self, tmp_path, monkeypatch):
        """A copy of the tree (the device machine's) records the commit its run command names, not its own
        HEAD; a value that is no commit is an error before anything is written."""
        monkeypatch.setenv("MHC_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
        store = GoldenStore(tmp_path)
        _write(store, 1.0)
        assert "0123456789abcdef0123456789abcdef01234567" == store.load(HW, "s", "c")[1]["git_commit"]
        monkeypatch.setenv("MHC_GIT_COMMIT", "main; rm -rf")
        with pytest.raises(ValueError, match="MHC_GIT_COMMIT='main; rm -rf' is not a git commit"):
            _write(store, 2.0, case="d")
        assert not (tmp_path / HW / "s" / "d.json").exists()

    def test_hardware_keys_listed(self, tmp_path):
        """hardware_keys lists every key that has the case."""
        store = GoldenStore(tmp_path)
        _write(store, 1.0, hw="dgx_h100")
        _write(store, 1.0, hw="h200")
        assert ["dgx_h100", "h200"] == store.hardware_keys("s", "c")

    def test_bad_case_name(self, tmp_path):
        """A case name with a path separator raises ValueError naming the field."""
        with pytest.raises(ValueError, match=r"case='\.\./x'"):
            GoldenStore(tmp_path).files(HW, "s", "../x")


class TestAtomicWrites:
    def test_nonfinite_write_leaves_no_trace(self, tmp_path, tree):
        """A NaN write is refused before any file, directory or lock is created."""
        store = GoldenStore(tmp_path / "golden")
        g = {"lm loss": series_from_list([1.0, float("nan")])}
        with pytest.raises(NonFiniteError, match="metric 'lm loss' step 2"):
            store.write(HW, "s", "c", g, build_meta(hw=HW, suite="s", case="c", golden=g, source="t"))
        assert {} == tree(tmp_path)
        assert not (tmp_path / "golden").exists()

    def test_concurrent_recalibrations_never_mix(self, tmp_path, python, subprocess_env):
        """Two recalibrations started at once leave one writer's json and meta, never a mix."""
        env = dict(subprocess_env, **{PAUSE_ENV_VAR: "0.3"})
        start = time.time() + 1.0
        procs = [
            subprocess.Popen([python, "-c", WRITER, str(tmp_path), v, r, str(start)], env=env)
            for v, r in (("1.0", "2"), ("2.0", "3"))
        ]
        assert [0, 0] == [p.wait(timeout=60) for p in procs]
        assert time.time() - start >= 0.6, "the two writes overlapped: each pauses 0.3 s inside the lock"
        golden, meta = GoldenStore(tmp_path).load(HW, "s", "c")  # validates the digest: json and meta agree
        loss = set(golden["lm loss"].values.values())
        zeros = set(golden["num-zeros"].values.values())
        assert loss in ({1.0}, {2.0})
        assert {2 * next(iter(loss))} == zeros
        assert {1.0: 2, 2.0: 3}[next(iter(loss))] == meta["repeats"]
        assert [] == [p.name for p in (tmp_path / HW / "s").iterdir() if p.name.endswith(".tmp")]

    def test_killed_writer_keeps_old_file(self, tmp_path, python, subprocess_env):
        """A writer SIGKILLed between temp write and replace leaves the old pair; the next write succeeds."""
        store = GoldenStore(tmp_path)
        _write(store, 1.0)
        d = tmp_path / HW / "s"
        before = {p.name: p.read_bytes() for p in d.iterdir() if not p.name.startswith(".")}
        env = dict(subprocess_env, **{PAUSE_ENV_VAR: "60"})
        proc = subprocess.Popen(
            [python, "-c", WRITER, str(tmp_path), "7.0", "1", "0"], env=env, start_new_session=True
        )
        try:
            deadline = time.time() + 30
            while not any(p.name.endswith(".tmp") for p in d.iterdir()) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # let the meta temp file land too
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert any(p.name.endswith(".tmp") for p in d.iterdir()), "the writer never reached its pause"
        assert before == {p.name: p.read_bytes() for p in d.iterdir() if not p.name.startswith(".")}
        _write(store, 3.0)
        assert {3.0} == set(store.load(HW, "s", "c")[0]["lm loss"].values.values())
        assert [] == [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


class TestReadErrors:
    def test_missing_golden_lists_keys_and_command(self, tmp_path):
        """A missing file for this hardware lists the keys that exist and the recalibrate command."""
        store = GoldenStore(tmp_path)
        _write(store, 1.0, hw="dgx_h100")
        _write(store, 1.0, hw="h200")
        with pytest.raises(MissingGoldenError) as exc:
            store.load(HW, "s", "c")
        msg = str(exc.value)
        assert "Hardware keys with this case: dgx_h100, h200" in msg
        assert f"mhc-harness recalibrate s c --hw {HW} --repeats 5" in msg

    def test_corrupt_meta_names_position(self, tmp_path):
        """Malformed meta JSON names the meta file and the line/column."""
        f = _write(GoldenStore(tmp_path), 1.0)
        f.meta.write_text('{"hardware": \n', encoding="utf-8")
        with pytest.raises(MetaError, match=r"c\.meta\.json: malformed JSON at line 2 column 1"):
            GoldenStore(tmp_path).load(HW, "s", "c")

    def test_partial_meta_names_missing_keys(self, tmp_path):
        """A meta file missing keys names them."""
        f = _write(GoldenStore(tmp_path), 1.0)
        f.meta.write_text(json.dumps({"hardware": HW}), encoding="utf-8")
        with pytest.raises(MetaError, match=r"partial meta file, missing keys \['case', 'date'"):
            GoldenStore(tmp_path).load(HW, "s", "c")

    def test_meta_out_of_sync(self, tmp_path):
        """A golden file changed behind its meta is reported as out of sync."""
        store = GoldenStore(tmp_path)
        f = _write(store, 1.0)
        f.json.write_text(json.dumps({"lm loss": series_from_list([2.0]).to_json()}), encoding="utf-8")
        with pytest.raises(MetaError, match="out of sync"):
            store.load(HW, "s", "c")

    def test_no_meta_is_allowed(self, tmp_path):
        """A golden file without meta (an imported Megatron file) loads with meta None."""
        f = _write(GoldenStore(tmp_path), 1.0)
        f.meta.unlink()
        assert GoldenStore(tmp_path).load(HW, "s", "c")[1] is None


class TestWrittenFiles:
    def test_new_files_follow_the_umask_and_rewrites_keep_the_mode(self, tmp_path):
        """A new golden and its meta are 0644 under umask 022 (not mkstemp's 0600); a rewrite keeps a set mode."""
        store = GoldenStore(tmp_path)
        old = os.umask(0o022)
        try:
            f = _write(store, 1.0)
        finally:
            os.umask(old)
        assert (f.json.stat().st_mode & 0o777, f.meta.stat().st_mode & 0o777) == (0o644, 0o644)
        os.chmod(f.json, 0o640)
        _write(store, 2.0)
        assert f.json.stat().st_mode & 0o777 == 0o640

    def test_a_target_that_is_a_directory_writes_nothing(self, tmp_path):
        """If the meta path is a directory, the write is refused before the golden json is replaced."""
        from harness.golden.errors import GoldenFormatError

        store = GoldenStore(tmp_path)
        f = _write(store, 1.0)
        before = f.json.read_text()
        f.meta.unlink()
        f.meta.mkdir()
        with pytest.raises(
            GoldenFormatError, match=r"c\.meta\.json: exists and is not a regular file; nothing written"
        ):
            _write(store, 2.0)
        assert f.json.read_text() == before
        assert not [p.name for p in f.directory.iterdir() if p.name.endswith(".tmp")]
