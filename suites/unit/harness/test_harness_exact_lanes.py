"""Exact values per numerics fingerprint: which lane decides, exact sets, and --exact-only."""

from __future__ import annotations

import json

import pytest

from harness.golden.case_check import GoldenSettings, check_case
from harness.golden.compare import ApproximateCheck, ExactCheck
from harness.golden.errors import MetaError, RecalibrationError
from harness.golden.fingerprint import NumericsFingerprint
from harness.golden.hardware import HardwareKey
from harness.golden.recalibrate import Repeat, recalibrate
from harness.golden.schema import golden_digest, series_from_list
from harness.golden.store import GoldenStore, build_meta

HW = "cpu_x86_64"
LOSS = [5.5522298, 5.5764155, 5.2219486, 4.9524979]
ULP = [x * (1 + 1e-7) for x in LOSS]
"""The same curve one float32 ulp away: what another x86 model computes."""
CHECKS = {"lm loss": (ExactCheck(), ApproximateCheck(rtol=1e-5, max_misses=0))}


def _fp(model: str, **kw) -> NumericsFingerprint:
    return NumericsFingerprint(
        device="cpu",
        cpu_vendor="GenuineIntel",
        cpu_model=model,
        cpu_capability="AVX2",
        threads=1,
        torch="2.13.0+cpu",
        **kw,
    )


RECORDER, OTHER = _fp("Xeon 6/207/2"), _fp("EPYC 25/1/0")


def _store(tmp_path, *, numerics=RECORDER) -> GoldenStore:
    store = GoldenStore(tmp_path / "golden")
    g = {"lm loss": series_from_list(LOSS)}
    store.write(
        HW, "s", "c", g, build_meta(hw=HW, suite="s", case="c", golden=g, source="test", numerics=numerics)
    )
    return store


def _check(store, values, fingerprint, checks=CHECKS):
    settings = GoldenSettings(golden_dir=store.root, hw=HardwareKey(key=HW, rule="test", source="option"))
    return check_case(
        settings, suite="s", case="c", metrics={"lm loss": values}, checks=checks, fingerprint=fingerprint
    )


def _exact(store, values, fingerprint, *, repeats=2, **kw):
    return recalibrate(
        store=store,
        hw=HW,
        suite="s",
        case="c",
        repeats=repeats,
        exact_only=True,
        runner=lambda i: Repeat(metrics={"lm loss": values}, fingerprint=fingerprint),
        out=kw.pop("out", lambda s: None),
        **kw,
    )


class TestLanes:
    def test_recording_fingerprint_enforces_exact(self, tmp_path):
        """On the fingerprint that recorded the reference, one ulp fails the exact lane."""
        store = _store(tmp_path)
        assert _check(store, LOSS, RECORDER).status == "pass"
        o = _check(store, ULP, RECORDER)
        assert o.status == "fail" and o.lane == "exact"
        assert "lm loss [exact]: 4 of 4 steps differ" in o.message
        assert o.lane_reason.startswith(
            f"exact: enforced, this fingerprint recorded the reference ({RECORDER.id}"
        )

    def test_other_fingerprint_exact_is_na_and_approximate_decides(self, tmp_path):
        """Elsewhere the exact check is n/a, naming both fingerprints, and the approximate lane decides."""
        o = _check(_store(tmp_path), ULP, OTHER)
        assert o.status == "pass" and o.lane == "approximate"
        exact = next(c for c in o.checks if c.check == "exact")
        assert exact.status == "n/a" and exact.ok
        assert f"exact: n/a, recorded on {RECORDER.label}; this machine {OTHER.label}" in exact.message
        assert o.lane_reason == exact.message.removeprefix("lm loss [exact]: ")

    def test_approximate_lane_still_fails_a_real_change_elsewhere(self, tmp_path):
        """A 1e-3 shift at one step fails on the other machine, naming metric and step."""
        shifted = list(ULP)
        shifted[2] *= 1 + 1e-3
        o = _check(_store(tmp_path), shifted, OTHER)
        assert o.status == "fail" and o.lane == "approximate"
        assert "lm loss [approx rtol=1e-05 atol=0 max_misses=0]: 1 of 4 steps outside the band" in o.message
        assert "  step 3: actual" in o.message and "exact: n/a, recorded on" in o.message

    def test_meta_without_fingerprint(self, tmp_path):
        """A reference whose meta predates fingerprints enforces exact values nowhere, and says so."""
        o = _check(_store(tmp_path, numerics=None), LOSS, RECORDER)
        assert (
            o.lane == "approximate"
            and "recorded on an unrecorded fingerprint (the meta predates" in o.lane_reason
        )

    def test_exact_only_check_without_a_lane_fails(self, tmp_path):
        """A metric with only an exact check, n/a here, fails: no lane decides it."""
        o = _check(_store(tmp_path), LOSS, OTHER, checks={"lm loss": ExactCheck()})
        assert (
            o.status == "fail"
            and "lm loss: no lane decides: its only check is exact, n/a on this machine" in o.message
        )


class TestExactSets:
    def test_exact_only_adds_this_machine_and_moves_nothing_else(self, tmp_path, tree):
        """--exact-only writes <case>.exact/<id>.json; the reference pair stays byte for byte; the exact
        lane is then enforced for that fingerprint."""
        store = _store(tmp_path)
        f = store.files(HW, "s", "c")
        ref = {p: p.read_bytes() for p in (f.json, f.meta)}
        lines: list[str] = []
        res = _exact(store, ULP, OTHER, out=lines.append)
        assert res.written and res.path == f.exact_json(OTHER.id)
        assert ref == {p: p.read_bytes() for p in (f.json, f.meta)}
        meta = json.loads(f.exact_meta(OTHER.id).read_text())
        assert meta["numerics"]["id"] == OTHER.id and meta["reference_sha256"] == golden_digest(
            store.load(HW, "s", "c")[0]
        )
        assert any("exact values for this fingerprint" in x for x in lines)
        o = _check(store, ULP, OTHER)
        assert (
            o.status == "pass"
            and o.lane == "exact"
            and "exact values of this fingerprint added" in o.lane_reason
        )
        o = _check(store, LOSS, OTHER)  # the reference's own values are one ulp off for this machine
        assert o.status == "fail" and "lm loss [exact]: 4 of 4 steps differ" in o.message
        third = _fp("Graviton")
        assert f"exact values also for {OTHER.id}" in _check(store, ULP, third).lane_reason

    def test_exact_only_keeps_other_machines_sets(self, tmp_path):
        """Adding a second machine's set leaves the first one's file unchanged."""
        store = _store(tmp_path)
        _exact(store, ULP, OTHER)
        first = store.files(HW, "s", "c").exact_json(OTHER.id).read_bytes()
        third = _fp("Graviton")
        _exact(store, LOSS, third)
        assert store.files(HW, "s", "c").exact_json(OTHER.id).read_bytes() == first
        assert [e.fingerprint_id for e in store.exact_sets(HW, "s", "c")] == sorted([OTHER.id, third.id])

    def test_exact_only_refusals_write_nothing(self, tmp_path, tree):
        """No reference, the reference's own fingerprint, no fingerprint, non-reproducible repeats: refused."""
        with pytest.raises(RecalibrationError, match="no reference at .* to add exact values beside"):
            _exact(GoldenStore(tmp_path / "empty"), LOSS, OTHER)
        store = _store(tmp_path)
        before = tree(store.root)
        with pytest.raises(
            RecalibrationError, match="recorded the reference .* recalibrate without --exact-only"
        ):
            _exact(store, LOSS, RECORDER)
        with pytest.raises(RecalibrationError, match="reported no numerics fingerprint"):
            _exact(store, LOSS, None)
        vals = [LOSS, ULP]
        with pytest.raises(
            RecalibrationError,
            match=r"no metric is bitwise reproducible over 2 repeats here "
            r"\(lm loss \(first differs at step 1",
        ):
            recalibrate(
                store=store,
                hw=HW,
                suite="s",
                case="c",
                repeats=2,
                exact_only=True,
                out=lambda s: None,
                runner=lambda i: Repeat(metrics={"lm loss": vals[i]}, fingerprint=OTHER),
            )
        with pytest.raises(RecalibrationError, match="repeat 2 ran under another numerics fingerprint"):
            fps = [OTHER, _fp("Graviton")]
            recalibrate(
                store=store,
                hw=HW,
                suite="s",
                case="c",
                repeats=2,
                exact_only=True,
                out=lambda s: None,
                runner=lambda i: Repeat(metrics={"lm loss": LOSS}, fingerprint=fps[i]),
            )
        _exact(store, ULP, OTHER, dry_run=True)
        assert before == tree(store.root)

    def test_non_reproducible_metric_is_left_out_and_named(self, tmp_path):
        """A metric whose repeats differ (a timing) is left out of the exact set, and the output says so."""
        store = _store(tmp_path)
        lines: list[str] = []
        recalibrate(
            store=store,
            hw=HW,
            suite="s",
            case="c",
            repeats=2,
            exact_only=True,
            out=lines.append,
            runner=lambda i: Repeat(
                metrics={"lm loss": ULP, "iteration-time": [0.1 + i] * 4}, fingerprint=OTHER
            ),
        )
        (entry,) = store.exact_sets(HW, "s", "c")
        assert list(entry.golden) == ["lm loss"]
        assert any(
            "left out, not bitwise reproducible over 2 repeats: iteration-time (first differs at step 1" in x
            for x in lines
        )

    def test_new_reference_drops_the_old_sets(self, tmp_path):
        """Rewriting the reference (a full recalibration) removes the sets recorded beside the old one,
        and says which before it writes."""
        store = _store(tmp_path)
        _exact(store, ULP, OTHER)
        lines: list[str] = []
        recalibrate(
            store=store,
            hw=HW,
            suite="s",
            case="c",
            repeats=1,
            out=lines.append,
            runner=lambda i: Repeat(metrics={"lm loss": [x + 1 for x in LOSS]}, fingerprint=RECORDER),
        )
        assert any(f"go with it: {OTHER.id}" in x for x in lines)
        assert store.exact_sets(HW, "s", "c") == []
        assert not store.files(HW, "s", "c").exact_json(OTHER.id).exists()

    def test_broken_exact_set_is_an_error(self, tmp_path):
        """An exact set edited by hand (digest mismatch) or missing its values is an error naming the file."""
        store = _store(tmp_path)
        _exact(store, ULP, OTHER)
        f = store.files(HW, "s", "c")
        f.exact_json(OTHER.id).write_text(f.exact_json(OTHER.id).read_text().replace("5.5", "5.6", 1))
        with pytest.raises(
            MetaError, match=f"{OTHER.id}.meta.json: golden_sha256 .* does not match its values"
        ):
            store.exact_sets(HW, "s", "c")
        o = _check(store, ULP, OTHER)
        assert o.status == "error" and "does not match its values" in o.message
        f.exact_json(OTHER.id).unlink()
        with pytest.raises(MetaError, match="its values .* are missing"):
            store.exact_sets(HW, "s", "c")

    def test_write_exact_refuses_a_moved_reference(self, tmp_path, tree):
        """write_exact checks, under the lock, that the reference is the one the set was recorded beside."""
        store = _store(tmp_path)
        g = {"lm loss": series_from_list(ULP)}
        meta = {
            "hardware": HW,
            "suite": "s",
            "case": "c",
            "date": "d",
            "source": "t",
            "repeats": 1,
            "versions": {},
            "git_commit": None,
            "reference_sha256": "0" * 64,
            "numerics": {"id": OTHER.id, "label": OTHER.label, "fingerprint": OTHER.to_json()},
        }
        before = tree(store.root)
        with pytest.raises(MetaError, match="the reference changed"):
            store.write_exact(HW, "s", "c", g, meta)
        assert {k: v for k, v in tree(store.root).items() if not k.endswith(".lock")} == {
            k: v for k, v in before.items() if not k.endswith(".lock")
        }
