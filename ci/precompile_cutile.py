#!/usr/bin/env python3
"""Build the precompiled cuTile cache that `ci/gpu_check.sh` carries to the GPU machine (no GPU here).

    python ci/precompile_cutile.py --out .whl --max-bytes 5000000 [--arch sm_90] [--jobs 2] \
        [--tokens 8192 --hidden 4096 --n 4 --dtype bf16 --variant megatron_dev]   # the sweep's shape

Writes `<out>/cutile-precompiled-<arch>.tar.xz` (cache.db + manifest.json, see
`tools.cutile.precompile`). Run it from the copy of the tree at the path the GPU run
will import `mhc_core` from (`bash ci/gpu_check.sh prepare` does): the entries hold that path.
Launch sets, in priority order (the size cap keeps a prefix; a GPU run JIT-compiles the rest;
`--sets` keeps only those named, e.g. `--sets perf,layer,parity` for a run without the sweep step):

    sweep   every candidate of `sweep_candidates.CANDIDATES` at the sweep's shape (the options above)
    perf    the perf suite's GPU cases (`tools/perf_cases.py`) that cuTile runs, forward and backward
    layer   every op at the layer benchmark's GPU size (T 4096, C 1024, n 4, bf16), each variant
    parity  every op at the GPU parity tests' sizes (n 2, 4, 8; bf16 and fp32)
    forms   the parity tests of the sweep's other formulations (their tiles, at their sizes)

The sweep times against the heuristics (`tiling.tuned(None)`), and its set is recorded so; the others under the tuning the GPU runtime will put in force on `--device` (a file in
`mhc_core/kernels/cutile/tuned/`, or `MHC_CUTILE_TUNING`; `tuning.resolve`).

Prints per set the launches kept, then the archive's size; exits 1 if a launch failed to compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mhc_core.kernels.cutile import CuTileBackend, tiling, tuning  # noqa: E402
from mhc_core.kernels.dispatch import bound_ops  # noqa: E402
from mhc_core.kernels.preflight import cutile_gap  # noqa: E402
from tools.cutile import gpu_cases, precompile  # noqa: E402
from tools.cutile.bench import ACT_DTYPES, add_shape_args  # noqa: E402
from tools.perf_cases import cases_for  # noqa: E402


def perf_launches() -> list[precompile.Recorded]:
    """The perf suite's GPU cases that cuTile runs (not those the perf test skips for a cuTile gap,
    such as hidden dropout in training), their inputs built on the CPU, forward then backward."""
    rec = precompile.LaunchRecorder()
    ops = bound_ops(CuTileBackend(rec))
    for case in cases_for("cuda"):
        if cutile_gap(case.op, n=case.n, dtype=case.dtype, dropout=case.dropout):
            continue
        inputs = dataclasses.replace(case, device="cpu").inputs(requires_grad=True)

        def run(case=case, inputs=inputs):
            out = getattr(ops, case.op)(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])

        precompile.record(rec, "perf", case.id, run)
    return rec.recorded


def forms_launches() -> list[precompile.Recorded]:
    """The formulation tests of `test_gpu_parity.py` (`tools.cutile.gpu_cases`): the ops each one runs, at its size."""
    both = (torch.bfloat16, torch.float32)
    runs: list[tuple[tuple[str, ...], tuple[int, ...], int, tuple[torch.dtype, ...], Any]] = [
        (("h_aggregate", "h_post_bda"), (4,), 300, both, forms) for forms in gpu_cases.STREAM_FORMS.values()
    ]
    runs += [
        (("mapping",), (2, 4), 1100, both, {"mapping_bwd": tiles})
        for tiles in gpu_cases.MAPPING_BWD_TILES.values()
    ]
    runs += [
        (("sinkhorn",), (2, 4, 8), 300, (torch.float32,), {"sinkhorn": tiling.SinkhornTiles(64, **kw)})
        for kw in gpu_cases.SINKHORN_FORMS.values()
    ]
    out = []
    for ops, ns, t, acts, overrides in runs:
        out += [
            r
            for r in precompile.ops_launches("forms", ns, t, (1024,), acts, overrides)
            if r.id.split("|")[0] in ops
        ]
    return out


SETS = ("sweep", "perf", "layer", "parity", "forms")
"""The launch sets, in priority order."""


def _sets(text: str) -> tuple[str, ...]:
    """`--sets` parsed: known names only, kept in `SETS`' priority order."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SETS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--sets {text!r}: unknown {unknown or 'empty'}; valid: {','.join(SETS)}"
        )
    return tuple(s for s in SETS if s in names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the archive")
    p.add_argument("--max-bytes", type=int, required=True, help="cap on the archive's size")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--device",
        default=tuning.REFERENCE_DEVICE,
        help="the GPU model the run will see (its tuning applies)",
    )
    p.add_argument(
        "--sets",
        type=_sets,
        default=SETS,
        help=f"comma-separated launch sets to compile, in this priority order: {','.join(SETS)}",
    )
    add_shape_args(p)
    args = p.parse_args(argv)
    act = ACT_DTYPES[args.dtype]
    start = time.time()
    launches = []
    if "sweep" in args.sets:
        launches += precompile.sweep_launches(
            tokens=args.tokens, n=args.n, hidden=args.hidden, dtype=act, variant=args.variant
        )
    tuned = tuning.resolve(args.device)
    print(f"tuning on {args.device}: {tuning.describe(tuned)}; sets: {','.join(args.sets)}", flush=True)
    with tiling.tuned(tuned):
        if "perf" in args.sets:
            launches += perf_launches()
        if "layer" in args.sets:
            for seq, batch, hidden, _heads in gpu_cases.LAYER_SIZES:
                launches += precompile.ops_launches("layer", (4,), seq * batch, (hidden,), (torch.bfloat16,))
        if "parity" in args.sets:
            for t, c in dict.fromkeys((*gpu_cases.PARITY_SIZES, *gpu_cases.MAPPING_PARITY_SIZES)):
                launches += precompile.ops_launches(
                    "parity", (2, 4, 8), t, (c,), (torch.bfloat16, torch.float32)
                )
        if "forms" in args.sets:
            launches += forms_launches()
    print(
        f"recorded {len(launches)} launches, {len(precompile.distinct(launches))} distinct "
        f"({time.time() - start:.0f} s)",
        flush=True,
    )
    entries, failures = precompile.build(launches, args.out, arch=args.arch, jobs=args.jobs)
    print(f"compiled {len(entries)} for {args.arch} ({time.time() - start:.0f} s)", flush=True)
    archive = args.out / precompile.ARCHIVE_NAME.format(arch=args.arch)
    kept, size = precompile.pack(
        entries, args.out / "cache.db", archive, arch=args.arch, max_bytes=args.max_bytes, failures=failures
    )
    (args.out / "cache.db").unlink()
    for name in ("sweep", "perf", "layer", "parity", "forms"):
        total = sum(1 for e in entries if e.launch.set == name)
        have = sum(1 for e in entries[:kept] if e.launch.set == name)
        print(f"  {name:7s} {have:4d} of {total:4d} kept")
    print(
        f"{archive}: {size} bytes, {kept} of {len(entries)} entries (cap {args.max_bytes}; "
        f"{time.time() - start:.0f} s)"
    )
    for launch, err in failures:
        print(f"FAILED {launch.set} {launch.id}: {err}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
