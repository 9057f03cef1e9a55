"""A peer of your own: `--peer-module MODULE:NAME` and the `mhc_suite.peers` entry points, from a
temporary directory, with the complete example of docs/conformance.md; bad ones are named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.peers.plugins import PeerPluginError, entry_point_peers, load_peer_spec

DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"


def _example() -> str:
    """The `my_mhc.py` block of docs/conformance.md, as the user copies it."""
    text = DOC.read_text(encoding="utf-8")
    return text.split("<!-- peer-example -->\n```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory holding the doc's `my_mhc.py`, the current directory, its modules forgotten after."""
    (tmp_path / "my_mhc.py").write_text(_example(), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("my_mhc", "broken_mhc", "not_a_peer")]:
        del sys.modules[name]


def test_doc_example_conforms_from_the_command_line(user_dir, capsys):
    """`mhc-harness conformance --peer-module my_mhc:MyPeer` checks the doc's peer: megatron_main, every check."""
    out = user_dir / "out"
    assert main(["conformance", "--peer-module", "my_mhc:MyPeer", "--peer", "my_mhc", "--out", str(out)]) == 0
    doc = json.loads((out / "conformance.json").read_text(encoding="utf-8"))
    row = next(p for p in doc["peers"] if p["peer"] == "my_mhc")
    score = row["scores"]["megatron_main"]
    assert row["best"] == "megatron_main" and score["pass"] == score["of"] > 0, row["scores"]
    assert "my_mhc" in capsys.readouterr().out


def test_instance_and_factory_are_peers_too(user_dir):
    """NAME may be an instance or a function returning a list of peers."""
    (user_dir / "my_factory.py").write_text(
        "from my_mhc import MyPeer\nONE = MyPeer(name='mine_a')\n"
        "def both():\n    return [MyPeer(name='mine_b'), MyPeer(name='mine_c')]\n",
        encoding="utf-8",
    )
    assert [p.name for p in load_peer_spec("my_factory:ONE")] == ["mine_a"]
    assert [p.name for p in load_peer_spec("my_factory:both")] == ["mine_b", "mine_c"]


@pytest.mark.parametrize(
    ("spec", "source", "message"),
    [
        ("my_mhc", None, "expected MODULE:NAME, e.g. my_pkg.my_mhc:MyPeer"),
        ("no_such_module_here:Peer", None, "module 'no_such_module_here' failed to import in"),
        (
            "broken_mhc:P",
            "import torch\nraise RuntimeError('my init failed')\n",
            "RuntimeError: my init failed",
        ),
        ("my_mhc:Missing", None, "has no 'Missing'; it has"),
        ("not_a_peer:THING", "THING = 42\n", "not a Peer (got int)"),
    ],
)
def test_bad_peer_module_is_named(user_dir, spec, source, message, capsys):
    """A spec without a colon, a module that fails to import, a missing name, a non-peer: named, exit 2."""
    if source is not None:
        (user_dir / f"{spec.split(':')[0]}.py").write_text(source, encoding="utf-8")
    with pytest.raises(PeerPluginError) as err:
        load_peer_spec(spec)
    assert spec in str(err.value) and message in str(err.value)
    assert main(["conformance", "--peer-module", spec, "--out", str(user_dir / "out")]) == 2
    assert message in capsys.readouterr().err


def test_entry_point_plugin_is_loaded(user_dir):
    """An installed distribution's `mhc_suite.peers` entry point gives its peer on every run."""
    info = user_dir / "my_mhc_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: my-mhc-plugin\nVersion: 1.0\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text("[mhc_suite.peers]\nmy_mhc = my_mhc:MyPeer\n", encoding="utf-8")
    assert [p.name for p in entry_point_peers()] == ["my_mhc"]
    (info / "entry_points.txt").write_text("[mhc_suite.peers]\nmine = my_mhc:NoSuchThing\n", encoding="utf-8")
    with pytest.raises(
        PeerPluginError, match=r"entry point mine = my_mhc:NoSuchThing \(mhc_suite.peers\): failed"
    ):
        entry_point_peers()


def test_an_installed_plugin_with_a_timing_is_timed_by_the_perf_suite(user_dir):
    """The doc's peer, installed as an entry point, is one of the perf suite's timed rows (one file, one line):
    its Sinkhorn conforms to its configuration at a small shape, and the ops it does not time say so."""
    import torch

    from suites.perf.peers import PeerCase, registry_peers

    info = user_dir / "my_mhc_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: my-mhc-plugin\nVersion: 1.0\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text("[mhc_suite.peers]\nmy_mhc = my_mhc:MyPeer\n", encoding="utf-8")
    registry_peers.cache_clear()
    try:
        rows = [r for r in registry_peers() if r.conformance_peer == "my_mhc"]
    finally:
        registry_peers.cache_clear()
    assert [r.name for r in rows] == ["my_mhc"] and rows[0].variant == "megatron_main"
    case = PeerCase(op="sinkhorn", tokens=8, n=4, hidden=8, dtype=torch.float32, device="cpu")
    assert rows[0].unavailable(case) is None
    ok, why = rows[0].conforms_at(case)
    assert ok, why
    coefficients = PeerCase(op="coefficients", tokens=8, n=4, hidden=8, dtype=torch.float32, device="cpu")
    assert rows[0].unavailable(coefficients) == "my_mhc has no coefficients entry point"
