#!/usr/bin/env python3
"""Export every cuTile kernel signature to TileIR bytecode and, with tileiras, compile cubins.

No GPU needed. For every launch signature the dispatch can produce
(`tools/cutile/signatures.py`), this script
1. exports TileIR bytecode (`export_kernel(..., output_format="tileir_bytecode")`): type and
   shape checks of the kernel, no toolkit needed;
2. when a `tileiras` is found (pip wheels of `cuda-tile[tileiras]`, PATH or $CUDA_HOME/bin),
   compiles cubins for each `--arch` (default sm_90 and sm_100).

By default every signature (n = 2, 4, 8; hidden >= 512 and the toy hidden 64) is exported to
bytecode and the n = 4, hidden >= 512 ones (Megatron's default, 49 signatures) are compiled for
both archs: 72 s of CPU, 1.5-2 minutes wall on two shared cores. `--full` compiles all 225
(about five times the cubin work, for a nightly job).

It prints one row per signature (kernel, signature id, bytecode bytes, cubin bytes per arch,
seconds) and exits 1 if any export or compile failed (0 otherwise). PATH / CUDA_HOME /
LD_LIBRARY_PATH for the pip wheels are set up by `mhc_core.kernels.cutile.toolchain`; the cuTile
disk cache is off unless `--cache`, so the timings are real compiles.

    python ci/check_cutile.py                     # bytecode for all, cubins (sm_90, sm_100) for n = 4
    python ci/check_cutile.py --full              # cubins for every signature
    python ci/check_cutile.py --n 2 --cubin-n 2   # only n = 2
    python ci/check_cutile.py --bytecode-only     # no tileiras needed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Row:
    kernel: str
    ident: str
    bytecode: int | None = None
    cubins: dict[str, int | None] | None = None
    seconds: float = 0.0
    error: str | None = None


_PLAN = None


def _wants_cubin(ident: str, cubin_ns: tuple[int, ...], full: bool) -> bool:
    return full or (any(f"-n{n}-" in ident for n in cubin_ns) and "-c64" not in ident)


def _check(index: int, all_archs: tuple[str, ...], cubin_ns: tuple[int, ...], full: bool) -> Row:
    from tools.cutile.signatures import export_bytecode, export_cubin, kernel_object

    launch = _PLAN[index]
    archs = all_archs if _wants_cubin(launch.id, cubin_ns, full) else ()
    row = Row(kernel=launch.kernel_name, ident=launch.id, cubins={a: None for a in all_archs})
    start = time.perf_counter()
    try:
        kernel = kernel_object(launch.kernel_name)
        row.bytecode = len(export_bytecode(launch, kernel))
        for arch in archs:
            row.cubins[arch] = len(export_cubin(launch, arch, kernel))
    except Exception as exc:  # report every failure, keep going
        first = str(exc).strip().splitlines()
        row.error = f"{type(exc).__name__}: {first[0] if first else ''}"[:300]
    row.seconds = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, action="append", help="residual streams to check (default: all supported)"
    )
    parser.add_argument(
        "--cubin-n", type=int, action="append", help="n whose signatures get cubins (default: 4)"
    )
    parser.add_argument("--full", action="store_true", help="cubins for every signature")
    parser.add_argument("--arch", action="append", help="cubin targets (default: sm_90 and sm_100)")
    parser.add_argument(
        "--bytecode-only", action="store_true", help="skip cubins even when tileiras is found"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--cache", action="store_true", help="allow the cuTile cubin disk cache")
    parser.add_argument("--filter", default="", help="only signature ids containing this text")
    args = parser.parse_args(argv)

    if not args.cache:
        os.environ["CUDA_TILE_CACHE_DIR"] = "off"
    from mhc_core.kernels.cutile import tiling, toolchain

    tc = toolchain.apply_env()
    try:
        import cuda.tile  # noqa: F401
    except ImportError as exc:
        print(f"check_cutile: cuda.tile is not importable ({exc}); pip install 'cuda-tile[tileiras]==1.7.0'")
        return 1

    archs: tuple[str, ...] = ()
    if not args.bytecode_only:
        if tc is None:
            print(
                "check_cutile: no tileiras found (pip wheels, PATH or $CUDA_HOME/bin): bytecode export only"
            )
        else:
            archs = tuple(args.arch or ("sm_90", "sm_100"))
            print(f"check_cutile: tileiras {tc.version} from {tc.source} ({tc.tileiras})")
            print(f"check_cutile: CUDA_HOME={os.environ.get('CUDA_HOME')}")

    from tools.cutile.signatures import BYTECODE_VERSION, signature_plan

    global _PLAN
    ns = tuple(sorted(set(args.n))) if args.n else tiling.SUPPORTED_N
    t0 = time.perf_counter()
    _PLAN = signature_plan(ns)
    cubin_ns = ns if args.full else tuple(sorted(set(args.cubin_n or (4,))))
    indices = [i for i, p in enumerate(_PLAN) if args.filter in p.id]
    print(
        f"check_cutile: {len(indices)} signatures for n in {ns} (planned in {time.perf_counter() - t0:.1f}s); "
        f"bytecode {BYTECODE_VERSION}"
        + (
            f", cubins {', '.join(archs)} for " + ("all" if args.full else f"n in {cubin_ns}, hidden >= 512")
            if archs
            else ""
        )
        + f"; {args.jobs} job(s)"
    )

    # Most expensive first, so the pool does not end on one long compile.
    indices.sort(key=lambda i: not _wants_cubin(_PLAN[i].id, cubin_ns, args.full))
    k = len(indices)
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("fork")) as pool:
            rows = list(pool.map(_check, indices, [archs] * k, [cubin_ns] * k, [args.full] * k))
    else:
        rows = [_check(i, archs, cubin_ns, args.full) for i in indices]
    rows = [r for _, r in sorted(zip(indices, rows, strict=True), key=lambda p: p[0])]  # plan order

    def size(v: int | None) -> str:
        return "-" if v is None else str(v)

    head = ["kernel", "signature", "bytecode_B", *(f"{a}_cubin_B" for a in archs), "seconds"]
    table = [
        [r.kernel, r.ident, size(r.bytecode), *(size(r.cubins[a]) for a in archs), f"{r.seconds:.2f}"]
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))
    failed = [r for r in rows if r.error]
    for r in failed:
        print(f"FAILED {r.ident} ({r.kernel}): {r.error}")
    wall = time.perf_counter() - t0
    print(
        f"check_cutile: {len(rows) - len(failed)}/{len(rows)} ok, compile time {sum(r.seconds for r in rows):.1f}s "
        f"summed, {wall:.1f}s wall"
    )
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
