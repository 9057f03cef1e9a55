"""Our integration against the committed recordings of upstream Megatron-LM's training (no tree needed).

Each recording (`suites/functional/recorded/`, made by `record_tree.py` from a tree) holds the tree's
per-step lm loss, grad norm and num-zeros on a recipe, trained from the initial weights our model of
that recipe writes. Here our model writes them again, our integration trains from them with the
tree's numerics, and every step must be inside the approximate bands of the recorded one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.launch.runs import RunResult
from harness.upstream.tree_report import TreeRow
from suites.functional import tree_diff
from suites.functional.record_tree import RECORDED_DIR
from suites.functional.tree_recording import load_recording

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RECORDINGS = sorted(RECORDED_DIR.glob("*.json"))


def test_recordings_are_committed():
    """At least upstream dev's recording of the TP2 x PP2 recipe is in the repository."""
    assert any(p.name == "megatron_lm_dev-gpt_tp2_pp2_mhc.json" for p in RECORDINGS), RECORDINGS


def _ours(rec, hw_key: str, tmp_path: Path, functional_runs) -> tuple[RunResult, bool | None]:
    """Our run of the recording's recipe with the tree's numerics, and whether its initial weights are bitwise
    the recording's (None: not dumped). Where the recipe already has the tree's numerics (the overrides change no
    argument), that run is the session's run of the recipe (its golden run): same model, seed and data, and the
    same initial weights by construction, so no second launch."""
    from harness.launch.runs import plan_case

    data = functional_runs.data_dir
    plain = plan_case(rec.case, hw_key, data_dir=data)
    if (
        plain.args
        == plan_case(rec.case, hw_key, data_dir=data, overrides=tree_diff.OUR_NUMERICS[rec.branch]).args
    ):
        return functional_runs.run(rec.case), None
    init = tmp_path / "init" / "init.pt"
    ours = tree_diff.run_ours(
        rec.case, hw_key, rec.branch, init, work_dir=tmp_path / "ours", data_dir=data, write_init=True
    )
    return ours, tree_diff.file_sha256(init) == rec.init_sha256


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_our_training_matches_the_recorded_tree(path, hw_key, tmp_path, tree_rows, functional_runs):
    """Every step of our run is inside the bands of the tree's recorded step (lm loss, grad norm, num-zeros, and
    what else of `tree_diff.METRICS` the recording holds: router and MTP losses, the stability gains)."""
    rec = load_recording(path)
    if rec.hw != hw_key:
        pytest.skip(f"{path.name} was recorded for {rec.hw}; this machine is {hw_key}")
    ours, same_init = _ours(rec, hw_key, tmp_path, functional_runs)
    rows = tree_diff.differences(ours.metrics, rec.metrics, bands=tree_diff.bands_for(rec.case, hw_key))
    init_note = {
        True: "identical",
        False: "NOT bitwise identical to the recording",
        None: "the recipe run's: it has the tree's numerics",
    }[same_init]
    report = (
        f"ours vs {rec.label} recorded ({rec.case}, initial weights {init_note}):\n"
        + tree_diff.describe(rows)
    )
    print(report)
    ok = all(r.outside == 0 and not r.only_a and not r.only_b for r in rows)
    tree_rows(
        TreeRow(
            suite="functional",
            case=rec.case,
            comparison="ours vs recorded tree",
            tree=rec.label,
            worst=tree_diff.worst(rows),
            ok=ok,
            note="initial weights differ" if same_init is False else "",
        )
    )
    compared = {r.metric for r in rows}
    assert (
        compared == set(tree_diff.METRICS) & set(rec.metrics)
        and {"lm loss", "grad-norm", "num-zeros"} <= compared
    ), report
    assert ok, report


def _write(tmp_path: Path, **changes) -> Path:
    doc = json.loads(RECORDINGS[0].read_text(encoding="utf-8"))
    doc.update(changes)
    path = tmp_path / RECORDINGS[0].name
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_changed_recipe_names_the_command_that_re_records(tmp_path):
    """A recording made from another version of its recipe is refused, naming the re-record command."""
    path = _write(tmp_path, recipe_sha256="0" * 64)
    with pytest.raises(
        ValueError,
        match=r"changed since the recording .*re-record with: python -m "
        r"suites\.functional\.record_tree --megatron-lm <tree> --case",
    ):
        load_recording(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "not a training recording (format 'other'"),
        ({"metrics": {}}, "has no lm loss steps"),
        ({"our_numerics": {"--mhc-variant": "paper"}}, "recorded against our numerics"),
    ],
)
def test_malformed_recording_is_named(tmp_path, changes, message):
    """A recording that is not one, has no steps, or was made against other numerics names its file."""
    path = _write(tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        load_recording(path)
    assert str(path) in str(err.value) and message in str(err.value)
