"""A saved matrix is used only where it was computed: the same code, interpreter and peers."""

from __future__ import annotations

import pickle

from harness.conformance import saved
from harness.conformance.matrix import Matrix, run_matrix
from harness.peers.mhc_core_peer import mhc_core_peers


def test_a_saved_matrix_loads_for_the_same_peers_and_code(tmp_path):
    """save then load gives the matrix back; other peers or a changed checkout give None (it is computed again)."""
    peers = mhc_core_peers()[:1]
    m = run_matrix(peers)
    path = tmp_path / "m.pickle"
    saved.save_matrix(m, path, [p.name for p in peers])
    back = saved.load_matrix(path, [p.name for p in peers])
    assert isinstance(back, Matrix) and back.peers[0].configuration == m.peers[0].configuration
    assert saved.load_matrix(path, ["another"]) is None
    doc = pickle.loads(path.read_bytes())
    path.write_bytes(pickle.dumps({**doc, "digest": "0" * 64}))  # as if the code changed since
    assert saved.load_matrix(path, [p.name for p in peers]) is None
    path.write_bytes(b"not a pickle")
    assert saved.load_matrix(path, [p.name for p in peers]) is None
    assert saved.load_matrix(tmp_path / "missing", [p.name for p in peers]) is None
