"""`mhc-harness conformance`: the matrix as JSON and Markdown, peer selection, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.cli import main
from harness.peers.megatron_lm import TreeError, tree_flavor


def test_writes_the_matrix_as_json_and_markdown(tmp_path, capsys):
    """The matrix of the named peers goes to conformance.json / .md; the summary names each peer's best variant and
    its determinism verdict."""
    assert 0 == main(
        [
            "conformance",
            "--peer",
            "mhc_core[megatron_dev]",
            "--peer",
            "megatron_lm[main]",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "mhc_core[megatron_dev] (0.1.0): conforms to megatron_dev" in out
    assert "megatron_lm[main] (main@d98e8a64ddf3): conforms to megatron_main" in out
    doc = json.loads((tmp_path / "conformance.json").read_text())
    assert [p["best"] for p in doc["peers"]] == ["megatron_dev", "megatron_main"]
    cell = doc["peers"][0]["cells"][0]
    assert {"check", "status", "max_abs", "ratio", "bound"} <= set(cell)
    md = (tmp_path / "conformance.md").read_text()
    assert "| megatron_lm[main] | main@d98e8a64ddf3 | megatron_main | paper 15/48, megatron_main 48/48" in md
    # The determinism column: a live peer's run-to-run difference is measured (0 for ours), a replayed one's n/a.
    ours, replayed = doc["peers"]
    assert ours["determinism"]["run_to_run"] == 0.0 and None not in ours["determinism"].values()
    assert replayed["determinism"] is None and "    determinism: n/a: a replayed recording is one run" in out
    assert "| verdict | determinism |" in md


def test_strict_fails_on_a_peer_that_differs(tmp_path, capsys, monkeypatch):
    """--strict exits 1 when an available peer does not pass every check of any variant or configuration
    (a Sinkhorn that ends on a row pass is no named option)."""
    (tmp_path / "faulty_peer.py").write_text(
        "from suites.conformance.mutants import MUTANTS\n"
        "PEER = next(m for m in MUTANTS if m.fault == 'Sinkhorn ends on a row pass')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    code = main(
        [
            "conformance",
            "--peer",
            "mutant[sinkhorn-ends-on-a-row-pass]",
            "--peer-module",
            "faulty_peer:PEER",
            "--out",
            str(tmp_path),
            "--strict",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "--strict: mutant[sinkhorn-ends-on-a-row-pass] do not conform" in out, out


def test_unknown_peer_lists_the_known_ones(tmp_path, capsys):
    """An unknown peer name is a usage error listing every known peer."""
    assert 2 == main(["conformance", "--peer", "nope", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "unknown peer(s) ['nope']; known: mhc_core[paper]" in err and "hf_deepseek_v4" in err


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (None, "not a directory"),
        ({}, "not a Megatron-LM tree (no megatron/core/__init__.py under it)"),
        (
            {"megatron/core/__init__.py": ""},
            "a Megatron-LM tree without mHC (no megatron/core/transformer/hyper_connection.py)",
        ),
        (
            {
                "megatron/core/__init__.py": "",
                "megatron/core/transformer/hyper_connection.py": "",
                "megatron/core/transformer/transformer_config.py": "x = 1",
            },
            "has neither enable_mhc_connections",
        ),
    ],
)
def test_a_bad_megatron_tree_is_named(tmp_path, capsys, layout, message):
    """A path that is not a Megatron-LM tree, or one without mHC, is refused naming it, before anything runs."""
    tree = tmp_path / "tree"
    if layout is not None:
        tree.mkdir()
        for rel, text in layout.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(text)
    with pytest.raises(TreeError, match=re.escape(message)):
        tree_flavor(tree)
    assert 2 == main(["conformance", "--megatron-lm", str(tree), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"--megatron-lm {tree}" in err and message.split(" (")[0] in err
    assert not (tmp_path / "out").exists()


def test_run_embeds_the_matrix_in_the_report(tmp_path, capsys):
    """`mhc-harness run --conformance` puts the matrix in the summary and report.md."""
    suites = tmp_path / "suites" / "tiny"
    suites.mkdir(parents=True)
    (suites / "test_tiny.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "out"
    assert 0 == main(
        [
            "run",
            "tiny",
            "--suites-dir",
            str(tmp_path / "suites"),
            "--out",
            str(out),
            "--no-plots",
            "--conformance",
            "--peer",
            "mhc_core[paper]",
            "--pytest-args",
            "-p no:hypothesispytest -p no:benchmark -p no:xdist",
        ]
    )
    assert "mhc_core[paper] (0.1.0): conforms to paper" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "## Conformance" in report and "| mhc_core[paper] | 0.1.0 | paper |" in report
    assert 0 == main(
        [
            "run",
            "tiny",
            "--suites-dir",
            str(tmp_path / "suites"),
            "--out",
            str(out),
            "--no-plots",
            "--pytest-args",
            "-p no:hypothesispytest -p no:benchmark -p no:xdist",
        ]
    )
    assert "## Conformance" not in (out / "report.md").read_text()  # no stale matrix


def test_a_tree_that_does_not_import_says_why(tmp_path, capsys):
    """A tree whose megatron.core fails to import (upstream needs triton) is refused with the import error
    and the interpreter's name, before any check runs."""
    core = tmp_path / "tree" / "megatron" / "core"
    (core / "transformer").mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('No module named triton (planted)')\n")
    (core / "transformer" / "hyper_connection.py").write_text("")
    (core / "transformer" / "transformer_config.py").write_text("enable_mhc_connections = True\n")
    assert 2 == main(["conformance", "--megatron-lm", str(tmp_path / "tree"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "its megatron.core failed to import in" in err and "No module named triton (planted)" in err
    assert "--megatron-lm-python" in err


def test_a_live_tree_matches_its_branchs_recording(tmp_path):
    """With MHC_MEGATRON_LM (a Megatron-LM checkout with mHC) and a Python that loads it (MHC_MEGATRON_LM_PYTHON),
    every row of the tree's peers has a verdict or a reasoned skip (no errors), each names the API generation
    the adapter found, and a main or dev generation gives the variant its branch's recording gives."""
    import os
    from pathlib import Path

    from harness.conformance.matrix import run_matrix
    from harness.conformance.registry import tree_peers

    tree = os.environ.get("MHC_MEGATRON_LM")
    if not tree:
        pytest.skip(
            "MHC_MEGATRON_LM is not set (a Megatron-LM main or dev checkout; the committed recordings "
            "stand in for it)"
        )
    peers = tree_peers(Path(tree), python=os.environ.get("MHC_MEGATRON_LM_PYTHON"))
    for row in run_matrix(peers).peers:
        assert "API generation " in row.description, row.description
        if row.skipped:
            assert "cuda.tile" in row.skipped, row.skipped
            continue
        assert not [c for c in row.cells() if c.status == "error"], row.peer
        generation = row.description.split("API generation ")[1].split(":")[0]
        want = {"main": "megatron_main", "dev": "megatron_dev"}.get(generation)
        if want is not None:
            assert row.best == want and row.conforms, row.peer


def test_the_single_pass_recorder_names_a_missing_file_and_writes_nothing(tmp_path, capsys):
    """`record_single_pass` without the single-pass file exits 2 naming it, before any tree is imported, and writes
    no recording."""
    from harness.conformance.record_single_pass import main as record

    out = tmp_path / "rec.json"
    code = record(
        [
            "--megatron-lm",
            str(tmp_path),
            "--single-pass",
            str(tmp_path / "missing.py"),
            "--file-commit",
            "9633c754",
            "--out",
            str(out),
        ]
    )
    assert code == 2 and "missing.py: no such file" in capsys.readouterr().err
    assert not out.exists()
