"""Upstream Megatron-LM's mHC from a source tree, timed beside ours (`suites/perf/tree_peers.py`).

Runs only with `MHC_MEGATRON_LM=PATH` (a main or dev checkout) and, where this Python cannot import the
tree (upstream imports triton), `MHC_MEGATRON_LM_PYTHON` (for instance `.tox/compat/bin/python`). The
rows go to `results/perf_megatron_lm.json` (or `MHC_PERF_TREE_JSON`), which
`python -m harness.perf.table results/perf.json results/perf_megatron_lm.json` prints beside the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.peers.megatron_lm import tree_flavor
from suites.perf.peers import smoke

pytestmark = pytest.mark.perf
ROOT = Path(__file__).resolve().parents[2]


def test_megatron_lm_tree_peers(request):
    """Every peer of the tree is timed at every op and direction, beside ours, where it conforms."""
    tree = os.environ.get("MHC_MEGATRON_LM")
    if not tree:
        pytest.skip(
            "no Megatron-LM tree given (MHC_MEGATRON_LM=PATH to a main or dev checkout, and "
            "MHC_MEGATRON_LM_PYTHON=a Python with triton, e.g. .tox/compat/bin/python)"
        )
    flavor = tree_flavor(Path(tree))
    out = Path(os.environ.get("MHC_PERF_TREE_JSON", ROOT / "results" / "perf_megatron_lm.json"))
    cmd = [
        os.environ.get("MHC_MEGATRON_LM_PYTHON", sys.executable),
        "-m",
        "suites.perf.tree_peers",
        "--megatron-lm",
        tree,
        "--out",
        str(out),
        *(["--smoke"] if smoke() else []),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    rows = [b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]]
    label = Path(tree).resolve().name  # the tree's peers are named by its folder (`make_peers`)
    peers = {
        "main": {f"megatron_lm[{label}]"},
        "dev": {f"megatron_lm[{label}]", f"megatron_lm[{label},fused]"},
    }[flavor]
    timed = {(r["peer"], r["op"], r["direction"]) for r in rows}
    missing = {
        (p, op, d) for p in peers for op in ("coefficients", "layer_mhc") for d in ("fwd", "fwdbwd")
    } - timed
    assert not missing, f"not timed (not conforming, see stderr): {sorted(missing)}\n{proc.stderr[-2000:]}"
    for r in rows:
        assert r["median_s"] > 0 and r["ours_compiled_s"] > 0 and r["roofline_ratio"] > 0, r
    request.node.user_properties.append(("perf_tree_json", str(out)))
