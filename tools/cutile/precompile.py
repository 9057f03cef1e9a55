"""Ahead-of-time cuTile compilation without a GPU: the kernels a GPU run will launch, compiled here
into a cuTile disk cache that the run reads instead of JIT-compiling them.

    python -m tools.cutile.precompile check DIR            # can this process use DIR's entries?
    python -m tools.cutile.precompile report DIR CACHE_DIR  # after a run: entries used, JIT-compiled

(building: `ci/precompile_cutile.py`, which `bash ci/gpu_check.sh prepare` runs.)

cuTile keys its disk cache (`CUDA_TILE_CACHE_DIR`, an SQLite file) by the tileiras version, the
target, the opt level and the kernel's TileIR bytecode, and the bytecode holds the absolute paths
of the kernel sources. Entries built here are therefore found only by a run that imports
`mhc_core` from the same path (`ci/gpu_check.sh` runs from a copy at the manifest's `root`), with
the same kernel sources (`sources`, a digest of `kernel_sources()`) and tileiras.

The launches are recorded, not listed: the real launch wrappers run on CPU tensors of the run's
shapes through `LaunchRecorder` (a `RecordingRuntime` that also keeps the occupancy hint each
launch would compile with). The signatures so derived are cuTile's own: `to_signature` of every
launch of the plan equals `KernelSignature.from_kernel_args` of the same arguments (checked with a
stub driver, `docs/cutile.md`). Array-shape divisibility is part of a signature, including that of
work arrays sized by the token count, so launches are recorded at the run's own sizes.

Output of `build`: `DIR/cache.db` (the kept entries, in priority order until the packed size
reaches the cap; metadata dropped, access time 0) and `DIR/manifest.json`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import lzma
import multiprocessing
import os
import shutil
import sqlite3
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import mhc_core.kernels.cutile as _cutile
from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.runtime import KERNEL_MODULES
from mhc_core.variants import Variant
from tools.cutile.recording import ArrayArg, ConstArg, RecordingRuntime, ScalarArg

__all__ = [
    "Recorded",
    "LaunchRecorder",
    "record",
    "sweep_launches",
    "ops_launches",
    "build",
    "pack",
    "check",
    "report",
    "kernel_sources",
    "sources_digest",
    "ARCHIVE_NAME",
]

ARCHIVE_NAME = "cutile-precompiled-{arch}.tar.xz"
_PACKAGE = Path(_cutile.__file__).resolve().parent
"""The product's cuTile package (as imported here), whose kernel sources the cache is keyed on."""
_REPO = _PACKAGE.parents[2]


@dataclass(frozen=True)
class Recorded:
    """One launch to compile: its set and readable id, the kernel, its abstract arguments and hint."""

    set: str
    id: str
    kernel_name: str
    args: tuple[ArrayArg | ScalarArg | ConstArg, ...]
    occupancy: int | None

    @property
    def identity(self) -> tuple:
        """What decides the compiled kernel (the cache key, given the sources and the compiler)."""
        return (self.kernel_name, self.args, self.occupancy)


class LaunchRecorder(RecordingRuntime):
    """`RecordingRuntime` that keeps `Recorded` launches, labelled `set` / `label` by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.set = ""
        self.recorded: list[Recorded] = []

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple) -> None:
        super().launch(grid, kernel_name, args)
        self.recorded.append(
            Recorded(
                self.set,
                f"{self.label}-{kernel_name.removesuffix('_kernel')}",
                kernel_name,
                self.launches[-1].args,
                tiling.occupancy(kernel_name),
            )
        )


def record(rec: LaunchRecorder, set_name: str, label: str, fn: Callable[[], object]) -> None:
    """Run `fn()` (forward and backward through `rec`'s ops) with launches labelled `set_name` / `label`."""
    rec.set, rec.label = set_name, label
    fn()


def sweep_launches(
    *,
    tokens: int,
    n: int,
    hidden: int,
    dtype: torch.dtype,
    variant: str,
    iterations: int = 20,
    keys: Sequence[str] | None = None,
) -> list[Recorded]:
    """Every launch of the tile sweep (`sweep.CANDIDATES`, in `KEY_ORDER`; only `keys` when given) at
    its shape, as the sweep runs them: against the heuristics, whatever tuning is in force
    (`tiling.tuned(None)`). Ids `key[i]-kernel`, `i` the candidate's index."""
    from mhc_core.kernels.cutile import CuTileBackend
    from mhc_core.kernels.dispatch import bound_ops
    from tools.cutile import sweep

    unknown = sorted(set(keys or ()) - set(sweep.CANDIDATES))
    if unknown:
        raise ValueError(f"sweep keys {unknown} are not in the sweep; valid: {', '.join(sweep.CANDIDATES)}")
    rec = LaunchRecorder()
    ops = bound_ops(CuTileBackend(rec))
    for key, cands in sweep.CANDIDATES.items():
        if keys is not None and key not in keys:
            continue
        for i, cand in enumerate(cands):
            with tiling.tuned(None), tiling.overridden(**sweep.override(key, cand)):

                def run(key=key):  # building the backward timer already runs the forward
                    for fn in sweep.timers(
                        ops, key, tokens, n, hidden, dtype, variant, iterations, device="cpu"
                    ).values():
                        fn()

                record(rec, "sweep", f"{key}[{i}]", run)
    return rec.recorded


def ops_launches(
    set_name: str,
    ns: Sequence[int],
    tokens: int,
    hidden: Sequence[int],
    acts: Sequence[torch.dtype],
    overrides: dict | None = None,
    variants: Sequence[Variant] | None = None,
) -> list[Recorded]:
    """Every op forward and backward at `[tokens, n, c]` for each `n` in `ns`, `c` in `hidden` and
    activation dtype (`variants`, default all, bias or not: `signatures.record_all`), inside
    `tiling.overridden(**overrides)`."""
    from tools.cutile.signatures import record_all

    rec = LaunchRecorder()
    rec.set = set_name
    with tiling.overridden(**(overrides or {})):
        if variants is None:
            record_all(rec, ns, tokens, tuple(hidden), tuple(acts))
        else:
            record_all(rec, ns, tokens, tuple(hidden), tuple(acts), tuple(variants))
    return rec.recorded


def distinct(launches: Sequence[Recorded]) -> list[Recorded]:
    """Each `identity` once, at its first (highest-priority) place."""
    seen: dict[tuple, Recorded] = {}
    for r in launches:
        seen.setdefault(r.identity, r)
    return list(seen.values())


def kernel_sources() -> list[Path]:
    """The kernel modules and the package modules they import, transitively: what the kernels'
    bytecode is compiled from (their text, line numbers and paths)."""
    prefix = "mhc_core.kernels.cutile."
    todo, seen = list(dict.fromkeys(KERNEL_MODULES.values())), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse((_PACKAGE / f"{name}.py").read_text())
        todo += [
            node.module.removeprefix(prefix)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix)
        ]
    return sorted(_PACKAGE / f"{name}.py" for name in seen)


def sources_digest() -> str:
    """sha256 over `kernel_sources()` (names and bytes)."""
    h = hashlib.sha256()
    for path in kernel_sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _root() -> str:
    return str(_REPO)


# ---------------------------------------------------------------------------------------------
# compiling (worker processes: cuTile reads CUDA_TILE_CACHE_DIR when it is imported)
# ---------------------------------------------------------------------------------------------


def _keys(db: Path) -> set[str]:
    if not db.exists():
        return set()
    with sqlite3.connect(db) as conn:
        return {k for (k,) in conn.execute("SELECT key FROM cache")}


def _compile_chunk(
    cache_dir: str, arch: str, chunk: list[tuple[int, Recorded]]
) -> list[tuple[int, str | None, str]]:
    """Compile `chunk` into `cache_dir` (the process's `CUDA_TILE_CACHE_DIR`, which cuTile reads once,
    when it is first imported); per launch (index, its new cache key or None, error or "")."""
    from tools.cutile.signatures import PlannedLaunch, export_cubin, kernel_object

    db = Path(cache_dir) / "cache.db"
    out = []
    for index, r in chunk:
        before = _keys(db)
        kernel = kernel_object(r.kernel_name, r.occupancy)  # the hint it was recorded with
        try:
            export_cubin(PlannedLaunch(r.id, r.kernel_name, r.args), arch, kernel)
        except Exception as exc:  # reported per launch; the run JIT-compiles (and reports) it anyway
            out.append((index, None, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        new = _keys(db) - before
        out.append(
            (index, new.pop() if len(new) == 1 else None, "" if len(new) <= 1 else f"{len(new)} new keys")
        )
    return out


def _worker(cache_dir: str, arch: str, chunk: list[tuple[int, Recorded]], conn) -> None:
    conn.send(_compile_chunk(cache_dir, arch, chunk))
    conn.close()


def _run_workers(jobs: list[tuple[str, str, list]]) -> list[list[tuple[int, str | None, str]]]:
    """`_compile_chunk(*job)` for each job, each in its own fresh interpreter (spawn) whose
    environment names its cache dir from the start: cuTile fixes its cache dir when first imported,
    which a child may do before any of our code runs (spawn re-imports the parent's main module)."""
    ctx = multiprocessing.get_context("spawn")
    procs, pipes = [], []
    saved = os.environ.get("CUDA_TILE_CACHE_DIR")
    try:
        for cache_dir, arch, chunk in jobs:
            os.environ["CUDA_TILE_CACHE_DIR"] = cache_dir  # copied into the child at start
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(cache_dir, arch, chunk, send))
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(recv)
    finally:
        if saved is None:
            os.environ.pop("CUDA_TILE_CACHE_DIR", None)
        else:
            os.environ["CUDA_TILE_CACHE_DIR"] = saved
    results = []
    for proc, recv in zip(procs, pipes, strict=True):
        try:
            results.append(recv.recv())
        except EOFError:
            results.append(None)
        proc.join()
    crashed = [
        j for j, (proc, res) in enumerate(zip(procs, results, strict=True)) if res is None or proc.exitcode
    ]
    if crashed:
        raise RuntimeError(
            f"precompile.build: worker(s) {crashed} died (exit codes "
            f"{[procs[j].exitcode for j in crashed]}) before returning their results"
        )
    return results


@dataclass(frozen=True)
class Entry:
    """One compiled launch in the output cache."""

    launch: Recorded
    key: str
    cubin_bytes: int
    xz_bytes: int


def build(
    launches: Sequence[Recorded], out_dir: Path, *, arch: str = "sm_90", jobs: int = 2
) -> tuple[list[Entry], list[tuple[Recorded, str]]]:
    """Compile the distinct `launches` for `arch` into `out_dir/cache.db` (all of them, in order).

    Returns the entries and (launch, error) per launch that did not compile."""
    plan = distinct(launches)
    if not plan:
        raise ValueError("precompile.build: no launches to compile")
    jobs = max(1, min(jobs, len(plan)))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="precompile-", dir=out_dir))
    chunks = [[(i, r) for i, r in enumerate(plan) if i % jobs == j] for j in range(jobs)]
    results = _run_workers([(str(work / f"w{j}"), arch, c) for j, c in enumerate(chunks)])
    by_index = {i: (key, err, j) for j, res in enumerate(results) for i, key, err in res}
    empty = [j for j in range(jobs) if not (work / f"w{j}" / "cache.db").is_file()]
    if empty:
        errors = [err or "no new cache entry" for res in results for _, key, err in res if key is None][:3]
        shutil.rmtree(work)
        raise RuntimeError(
            f"precompile.build: worker(s) {empty} wrote no cuTile cache ({len(plan)} launches); "
            f"first errors: {errors}"
        )
    db = out_dir / "cache.db"
    db.unlink(missing_ok=True)
    shutil.copy(work / "w0" / "cache.db", db)  # cuTile's own schema
    workers = [sqlite3.connect(work / f"w{j}" / "cache.db") for j in range(jobs)]
    entries, failures = [], []
    try:
        with sqlite3.connect(db) as conn:
            conn.execute("DELETE FROM cache")
            for i, launch in enumerate(plan):
                key, err, j = by_index[i]
                if key is None:
                    failures.append((launch, err or "no new cache entry"))
                    continue
                (blob,) = workers[j].execute("SELECT blob FROM cache WHERE key = ?", (key,)).fetchone()
                conn.execute(
                    "INSERT OR IGNORE INTO cache (key, blob, blob_size, atime, metadata) VALUES (?, ?, ?, 0, NULL)",
                    (key, blob, len(blob)),
                )
                entries.append(Entry(launch, key, len(blob), len(lzma.compress(blob, preset=6))))
    finally:
        for w in workers:
            w.close()
    shutil.rmtree(work)
    return entries, failures


def _manifest(
    entries: Sequence[Entry], dropped: Sequence[Entry], arch: str, failures: Sequence[tuple[Recorded, str]]
) -> dict:
    import cuda.tile

    from mhc_core.kernels.cutile.toolchain import find_toolchain

    tc = find_toolchain()
    return {
        "arch": arch,
        "root": _root(),
        "sources": sources_digest(),
        "cuda_tile": cuda.tile.__version__,
        "tileiras": tc.version if tc else "unknown",
        "entries": [
            {"set": e.launch.set, "id": e.launch.id, "key": e.key, "bytes": e.cubin_bytes} for e in entries
        ],
        "dropped": [{"set": e.launch.set, "id": e.launch.id} for e in dropped],
        "failed": [{"set": r.set, "id": r.id, "error": err} for r, err in failures],
    }


def _write_archive(db: Path, manifest: dict, keep: set[str], archive: Path) -> int:
    """`archive` (tar.xz): a copy of `db` holding only the `keep` keys, and the manifest. Its size."""
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp, "cache.db")
        shutil.copy(db, small)
        with sqlite3.connect(small) as conn:
            for (key,) in conn.execute("SELECT key FROM cache").fetchall():
                if key not in keep:
                    conn.execute("DELETE FROM cache WHERE key = ?", (key,))
            conn.commit()
        with sqlite3.connect(small) as conn:
            conn.execute("VACUUM")
        Path(tmp, "manifest.json").write_text(json.dumps(manifest, indent=1))
        part = archive.with_name(archive.name + ".part")
        # typeshed types preset as a level 0-9; lzma also takes a level or-ed with PRESET_EXTREME
        with tarfile.open(part, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:  # type: ignore[call-overload]
            tar.add(small, "cache.db")
            tar.add(Path(tmp, "manifest.json"), "manifest.json")
        part.replace(archive)  # never a half-written archive under the final name
    return archive.stat().st_size


def pack(
    entries: Sequence[Entry],
    db: Path,
    archive: Path,
    *,
    arch: str,
    max_bytes: int,
    failures: Sequence[tuple[Recorded, str]] = (),
) -> tuple[int, int]:
    """Write `archive` with the longest prefix of `entries` (priority order) that packs into
    `max_bytes`. Returns (entries kept, archive bytes)."""
    keep, last = len(entries), None  # last: (size, estimated bytes dropped since)
    while True:
        kept, dropped = list(entries[:keep]), list(entries[keep:])
        size = _write_archive(db, _manifest(kept, dropped, arch, failures), {e.key for e in kept}, archive)
        if size <= max_bytes or keep == 0:
            return keep, size
        # Each entry alone (xz_bytes) packs worse than next to similar ones: scale the estimate by
        # what the last drop actually saved (first by the whole archive's ratio), so that the cut
        # converges in a few packs (each is a minute of xz).
        scale = (
            size / max(1, sum(e.xz_bytes for e in kept))
            if last is None
            else (last[0] - size) / max(1, last[1])
        )
        scale = min(1.0, max(0.01, scale))
        need, est = (size - max_bytes) * 1.05, 0
        start = keep
        while keep > 0 and (est * scale < need or keep == start):
            keep -= 1
            est += entries[keep].xz_bytes
        last = (size, est)


# ---------------------------------------------------------------------------------------------
# on the GPU machine
# ---------------------------------------------------------------------------------------------


def _load_manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"precompile: cannot read {path}: {type(exc).__name__}: {exc}") from exc


def check(directory: Path) -> list[str]:
    """Why this process would not find `directory`'s entries (empty: it would)."""
    from mhc_core.kernels.cutile.toolchain import find_toolchain

    m = _load_manifest(directory)
    why = []
    if m.get("root") != _root():
        why.append(f"mhc_core is imported from {_root()}, the entries were built under {m.get('root')}")
    if m.get("sources") != sources_digest():
        why.append(
            f"kernel sources differ (digest {sources_digest()[:12]} here, {str(m.get('sources'))[:12]} built)"
        )
    tc = find_toolchain()
    if tc is None or tc.version != m.get("tileiras"):
        why.append(f"tileiras {tc.version if tc else 'missing'} here, {m.get('tileiras')} built")
    try:
        import cuda.tile

        if cuda.tile.__version__ != m.get("cuda_tile"):
            why.append(f"cuda-tile {cuda.tile.__version__} here, {m.get('cuda_tile')} built")
    except ImportError:
        why.append("cuda.tile is not importable")
    return why


def report(directory: Path, cache_dir: Path) -> str:
    """One line: of the manifest's entries, how many a run looked up (access time set), and how
    many kernels it JIT-compiled itself (keys not in the manifest)."""
    m = _load_manifest(directory)
    ours = {e["key"]: e for e in m["entries"]}
    with sqlite3.connect(cache_dir / "cache.db") as conn:
        rows = conn.execute("SELECT key, atime FROM cache").fetchall()
    used = sum(1 for key, atime in rows if key in ours and atime > 0)
    jit = sum(1 for key, _ in rows if key not in ours)
    return (
        f"precompiled: {used} of {len(ours)} entries used; {jit} kernels JIT-compiled at run time "
        f"({len(m.get('dropped', []))} launches left out by the size cap, {len(m.get('failed', []))} failed to build)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="exit 1 with the reasons when this process would not find DIR's entries")
    c.add_argument("dir", type=Path)
    r = sub.add_parser(
        "report", help="print how many entries a run used and how many kernels it JIT-compiled"
    )
    r.add_argument("dir", type=Path)
    r.add_argument("cache_dir", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "check":
            why = check(args.dir)
            print(
                "precompiled entries usable"
                if not why
                else "precompiled entries not usable: " + "; ".join(why)
            )
            return 1 if why else 0
        print(report(args.dir, args.cache_dir))
    except (ValueError, sqlite3.Error, OSError) as exc:
        print(f"precompile {args.cmd}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
