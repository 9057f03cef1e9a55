"""A computed conformance matrix kept for the test session that follows (`mhc-harness conformance --save-matrix`).

The conformance env runs the matrix of the default peers once for `results/` and its tests assert on the same
matrix; computing it again in each pytest worker cost about 40 s per worker on 2 cores. A saved matrix carries the
sha256 of the code and data it was computed from (every `.py` under `mhc_core/` and `harness/`, the committed
recordings) and the interpreter that computed it; `load_matrix` returns None for one that does not match the
checkout and interpreter it is loaded in, so an edited checkout never asserts on a stale matrix.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from pathlib import Path

from harness.conformance.matrix import Matrix

__all__ = ["ENV_VAR", "load_matrix", "save_matrix", "source_digest"]

ENV_VAR = "MHC_CONFORMANCE_MATRIX"
"""Where the conformance suite looks for a saved matrix of the default peers (tox's conformance env sets it)."""
_ROOT = Path(__file__).resolve().parents[2]


def source_digest() -> str:
    """sha256 over the code and data a matrix depends on, and this interpreter."""
    h = hashlib.sha256(sys.executable.encode())
    files = sorted(
        [
            *(_ROOT / "mhc_core").rglob("*.py"),
            *(_ROOT / "harness").rglob("*.py"),
            *(_ROOT / "harness" / "conformance" / "recorded").glob("*.json"),
        ]
    )
    for f in files:
        h.update(str(f.relative_to(_ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def save_matrix(matrix: Matrix, path: Path, peers: list[str]) -> None:
    """Write `matrix` (of the peers named `peers`) to `path` atomically, with the source digest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(pickle.dumps({"digest": source_digest(), "peers": peers, "matrix": matrix}))
    tmp.replace(path)


def load_matrix(path: Path, peers: list[str]) -> Matrix | None:
    """The matrix saved at `path` if it was computed from this checkout and interpreter for exactly `peers`,
    else None (missing, unreadable, stale or of other peers)."""
    try:
        doc = pickle.loads(Path(path).read_bytes())  # noqa: S301 - written by save_matrix in this checkout
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
    if not isinstance(doc, dict) or doc.get("digest") != source_digest() or doc.get("peers") != peers:
        return None
    matrix = doc.get("matrix")
    return matrix if isinstance(matrix, Matrix) else None
