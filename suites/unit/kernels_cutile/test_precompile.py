"""Ahead-of-time cuTile compilation (`tools.cutile.precompile`): recording, the cache it
builds, the size cap, the checks a GPU run makes, and that cuTile's own JIT launch path finds its
entries (a stand-in driver, `stub_driver.py`; no GPU).

Recording needs no `cuda.tile`; building needs `cuda.tile` and tileiras (the tox env `kernels`).
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhc_core.kernels.cutile import toolchain
from mhc_core.variants import Variant
from suites.unit.kernels_cutile import stub_driver
from tools.cutile import precompile, sweep
from tools.cutile.recording import ArrayArg

ROOT = Path(__file__).resolve().parents[3]
SHAPE = dict(n=4, t=64, c=512)
VARIANT = Variant.MEGATRON_DEV


def test_sweep_launches_are_labelled_by_key_and_keep_their_hints():
    """Every sweep launch carries its set and candidate (`key[i]`); occupancy candidates keep their hint."""
    recs = precompile.sweep_launches(tokens=64, n=4, hidden=256, dtype=torch.bfloat16, variant="megatron_dev")
    assert {r.set for r in recs} == {"sweep"}
    assert all(r.id.split("[")[0] in sweep.CANDIDATES for r in recs), [r.id for r in recs][:5]
    hinted = {r.occupancy for r in recs if r.id.startswith("h_post_bda_bwd_occupancy[")}
    assert {2, 4, 8} <= hinted, hinted
    assert len(precompile.distinct(recs)) < len(recs)


def test_size_one_dims_are_recorded():
    """`ArrayArg.of` marks size-1 dims (the JIT makes them shape constants), and only when there are some."""
    assert ArrayArg.of(torch.zeros(1)).shape_one == (True,)
    assert ArrayArg.of(torch.zeros(3, 1, 16)).shape_one == (False, True, False)
    assert ArrayArg.of(torch.zeros(4, 16)).shape_one == ()


def test_kernel_sources_follow_the_kernel_imports():
    """The digested sources are the kernel modules and the package modules they import, no others."""
    names = {p.name for p in precompile.kernel_sources()}
    assert {
        "stream_kernels.py",
        "mapping_kernels.py",
        "sinkhorn_kernels.py",
        "mma.py",
        "constants.py",
    } == names


def _build(out: Path) -> dict:
    launches = precompile.ops_launches(
        "ops", (SHAPE["n"],), SHAPE["t"], (SHAPE["c"],), (torch.bfloat16,), variants=(VARIANT,)
    )
    entries, failures = precompile.build(launches, out, arch="sm_90", jobs=2)
    archive = out / "all.tar.xz"
    kept, size = precompile.pack(entries, out / "cache.db", archive, arch="sm_90", max_bytes=1 << 30)
    unpacked = out / "unpacked"
    shutil.unpack_archive(archive, unpacked)
    return {
        "launches": launches,
        "entries": entries,
        "failures": failures,
        "db": out / "cache.db",
        "archive": archive,
        "size": size,
        "kept": kept,
        "dir": unpacked,
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The n = 4, T = 64, C = 512 bf16 launches of every op in one variant, compiled for sm_90, and the archive
    (every variant's kernels compile in `test_export.py`; one keeps this build to a third of the time).

    Built once per run: under xdist the first worker builds it (~50 s of tileiras) in the run's
    shared base directory, under a file lock, and the others load what it recorded."""
    pytest.importorskip(
        "cuda.tile", reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')"
    )
    if toolchain.find_toolchain() is None:
        pytest.skip("no tileiras (pip install 'cuda-tile[tileiras]==1.7.0', the tox env `kernels`)")
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "precompiled-shared"
    record = out / "built.pickle"
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if not record.exists():
            out.mkdir()
            record.write_bytes(pickle.dumps(_build(out)))
    return pickle.loads(record.read_bytes())


def test_every_distinct_launch_gets_one_entry(built):
    """Each distinct launch compiles to its own cache key; none fails."""
    assert built["failures"] == []
    assert len(built["entries"]) == len(precompile.distinct(built["launches"]))
    assert len({e.key for e in built["entries"]}) == len(built["entries"])
    with sqlite3.connect(built["dir"] / "cache.db") as conn:
        rows = conn.execute("SELECT key, atime, metadata FROM cache").fetchall()
    assert {k for k, _, _ in rows} == {e.key for e in built["entries"]}
    assert all(atime == 0 and meta is None for _, atime, meta in rows)


def test_the_cap_keeps_a_prefix(built, tmp_path):
    """Under a cap below the full archive, the manifest keeps the first entries and lists the rest as dropped."""
    cap = built["size"] // 2
    kept, size = precompile.pack(
        built["entries"], built["db"], tmp_path / "capped.tar.xz", arch="sm_90", max_bytes=cap
    )
    assert size <= cap and 0 < kept < len(built["entries"])
    shutil.unpack_archive(tmp_path / "capped.tar.xz", tmp_path / "x")
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert [e["key"] for e in manifest["entries"]] == [e.key for e in built["entries"][:kept]]
    assert manifest["dropped"] == [{"set": "ops", "id": e.launch.id} for e in built["entries"][kept:]]


def test_check_accepts_this_tree_and_names_a_moved_root(built, tmp_path):
    """`check` is empty for the tree that built the entries; another root is named with both paths."""
    assert precompile.check(built["dir"]) == []
    moved = tmp_path / "moved"
    shutil.copytree(built["dir"], moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["root"] = "/elsewhere"
    (moved / "manifest.json").write_text(json.dumps(manifest))
    why = precompile.check(moved)
    assert len(why) == 1 and "/elsewhere" in why[0] and str(ROOT) in why[0], why


def test_report_counts_lookups_and_jit_compiles(built, tmp_path):
    """`report` counts the entries a run looked up and the kernels it compiled itself."""
    from cutile_cache._cache import cache_lookup, cache_store

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(built["dir"] / "cache.db", cache / "cache.db")
    assert cache_lookup(str(cache), built["entries"][0].key) is not None
    cache_store(str(cache), "0" * 64, b"cubin")
    line = precompile.report(built["dir"], cache)
    assert f"1 of {len(built['entries'])} entries used; 1 kernels JIT-compiled" in line, line


def test_a_malformed_manifest_is_named(tmp_path):
    """A missing or malformed manifest raises naming the file."""
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json"):
        precompile.check(tmp_path)


def test_jit_launches_find_the_precompiled_entries(built, tmp_path):
    """cuTile's own launch path (stand-in driver) finds every launch's kernel in the built cache: no tileiras
    call; and a second round of the same launches compiles nothing (no kernel re-specialises per call)."""
    lib = stub_driver.build_stub(tmp_path)
    if lib is None:
        pytest.skip("no C compiler to build the stand-in libcuda.so.1")
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(built["dir"] / "cache.db", cache / "cache.db")
    env = toolchain.find_toolchain().env()
    env.update(
        CUDA_TILE_CACHE_DIR=str(cache),
        PYTHONPATH=str(ROOT),
        LD_LIBRARY_PATH=f"{tmp_path}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "suites.unit.kernels_cutile.stub_driver",
            str(SHAPE["n"]),
            str(SHAPE["t"]),
            str(SHAPE["c"]),
            "bf16",
            str(VARIANT),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["launches"] == len(built["launches"])
    assert result["misses"] == 0 and result["errors"] == [], result
    assert result["compiles"] == len(built["entries"]) and result["recompiles"] == 0, result
    with sqlite3.connect(cache / "cache.db") as conn:
        used = conn.execute("SELECT COUNT(*) FROM cache WHERE atime > 0").fetchone()[0]
    assert used == len(built["entries"])


_MAIN_IMPORTS_CUDA_TILE = """
import os
import sys
from pathlib import Path
import cuda.tile  # noqa: F401  (ci/precompile_cutile.py's imports pull it in too)
import torch
from tools.cutile import precompile

if __name__ == "__main__":
    launches = precompile.ops_launches("ops", (4,), 64, (512,), (torch.bfloat16,))[:4]
    entries, failures = precompile.build(launches, Path(sys.argv[1]), jobs=2)
    print(len(entries), len(failures), os.environ.get("CUDA_TILE_CACHE_DIR"))
"""


def test_build_workers_cache_where_told_when_main_imports_cuda_tile(tmp_path):
    """The compile workers write their own caches even when the main script imports `cuda.tile` (spawn
    re-imports it in each child, and cuTile fixes its cache dir at import): the driver's case."""
    pytest.importorskip(
        "cuda.tile", reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')"
    )
    if toolchain.find_toolchain() is None:
        pytest.skip("no tileiras (pip install 'cuda-tile[tileiras]==1.7.0', the tox env `kernels`)")
    script = tmp_path / "driver.py"
    script.write_text(_MAIN_IMPORTS_CUDA_TILE)
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_TILE_CACHE_DIR=str(tmp_path / "elsewhere"))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["4", "0", str(tmp_path / "elsewhere")], (
        proc.stdout
    )  # and the variable restored


def test_precompile_script_records_the_perf_cases_cutile_runs(monkeypatch):
    """`ci/precompile_cutile.py` records every GPU perf case that cuTile runs, forward and backward, and
    leaves out those the perf test skips for a cuTile gap (today hidden dropout in training, which
    stopped the build before) instead of stopping on them. The GPU cases at T = 64, C = 256 (the
    launches' kinds, not their sizes, are what this checks)."""
    import dataclasses
    import importlib.util

    from mhc_core.kernels.preflight import cutile_gap
    from tools.perf_cases import cases_for

    spec = importlib.util.spec_from_file_location("precompile_cutile", ROOT / "ci" / "precompile_cutile.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cases = [dataclasses.replace(c, tokens=64, hidden=256) for c in cases_for("cuda")]
    monkeypatch.setattr(script, "cases_for", lambda device: cases)
    recs = script.perf_launches()
    gaps = {c.id for c in cases if cutile_gap(c.op, n=c.n, dtype=c.dtype, dropout=c.dropout)}
    labels = {r.id.removesuffix("-" + r.kernel_name.removesuffix("_kernel")) for r in recs}
    assert labels == {c.id for c in cases} - gaps, labels
    kernels = {r.kernel_name for r in recs}
    assert {"h_post_bda_fwd_kernel", "h_post_bda_bwd_kernel"} <= kernels and any(
        k.startswith("sinkhorn_bwd") for k in kernels
    ), kernels


def test_precompile_script_sets_keep_priority_order_and_name_bad_ones():
    """`--sets` keeps the named launch sets in the priority order (sweep first) whatever the order given, and
    an unknown or empty list is an error naming it and the valid sets."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("precompile_cutile", ROOT / "ci" / "precompile_cutile.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script._sets("parity, perf,layer") == ("perf", "layer", "parity")
    for bad in ("perf,sweeep", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="valid: sweep,perf,layer,parity,forms"):
            script._sets(bad)
