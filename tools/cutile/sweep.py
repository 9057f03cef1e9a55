"""Tile-size sweep of the cuTile kernels (GPU only): time each candidate through the real wrappers.

    python -m tools.cutile.sweep --tokens 8192 --hidden 4096 --n 4 --dtype bf16 --out sweep.json
    python -m tools.cutile.sweep --keys sinkhorn,mapping --warm-only   # JIT-compile only

Each candidate replaces one `tiling` choice (`tiling.overridden`) and times the op it drives:
`*_fwd` keys the forward, `*_bwd` keys the backward alone (replayed on a retained graph), and
`sinkhorn` (one tile for both) both directions. Per row: the median of single
CUDA-event-timed calls (`single_ms`, CPU launch cost included when the GPU waits for it), the mean
of back-to-back calls (`pipelined_ms`: the kernel's own time only when the GPU is the slower side;
for small ops it is the host's time per call), the GPU busy time per call of 5 profiled calls
(`device_ms`, `tools.device_time`: the kernels alone, what candidates are ranked by)
and GB/s of that time against `mhc_core.analysis.bytes_moved`, and whether the candidate computes
what the reference does on the same inputs (`max_rel_err`: the largest relative Frobenius error
over outputs, or over input gradients for the backward; `check` ok within `sweep_check.check_rtol`;
`--summary` and `--adopt` refuse a file's rows that the bounds of the version reading them refuse). The first
candidate of each key is the heuristic's default; the sweep times under `tiling.tuned(None)`, so a
shipped tuning does not change what "default" means. `--warm-only` runs each candidate once (JIT compile into the on-disk
cache), so several processes can compile disjoint `--keys` / `--index` in parallel before one
timing run (`python -m tools.cutile.sweep --list` prints the `key index` pairs).
`--summary sweep.json` (no GPU) prints, per key and direction, the default's time, the fastest
candidate and the speed-up; `--adopt sweep.json --out tuning.json` (no GPU) writes the winners
that passed their check as a tuning file (`mhc_core.kernels.cutile.tuning`), which
`MHC_CUTILE_TUNING` or a copy into `tuned/` puts in force. `--emulate` runs the same loop on
the CPU kernel interpreter (host-clock times that mean nothing; the tests check the tool with it).
The candidates are in `sweep_candidates`, the reference check in `sweep_check`. Benchmarks
measure; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

from mhc_core.analysis import bytes_moved
from mhc_core.kernels.cutile import tiling, tuning
from tools.cutile import adopt
from tools.cutile.bench import (
    ACT_DTYPES,
    add_shape_args,
    backward_fn,
    cutile_or_none,
    make_inputs,
    op_call,
    pipelined_ms,
    time_ms,
    write_json,
)
from tools.cutile.sweep_candidates import (
    CANDIDATES,
    KEY_ORDER,
    directions,
    op_of,
    override,
    tile_key,
)
from tools.cutile.sweep_check import CHECK_RTOL, deviation, grade
from tools.device_time import device_busy_seconds

# CANDIDATES, KEY_ORDER, override (sweep_candidates) and CHECK_RTOL, deviation (sweep_check) stay importable here.
__all__ = [
    "CANDIDATES",
    "KEY_ORDER",
    "CHECK_RTOL",
    "main",
    "timers",
    "deviation",
    "override",
    "regrade",
    "summary",
]


def timers(
    ops,
    key: str,
    t: int,
    n: int,
    c: int,
    act: torch.dtype,
    variant: str,
    iterations: int,
    device: str = "cuda",
) -> dict[str, Callable[[], object]]:
    """`{direction: fn}` timing `key`'s op with the ops bundle `ops`, on fresh inputs."""
    op = op_of(key)
    fn = op_call(ops, op, n, variant, iterations)
    inputs = [
        x.requires_grad_(True) if x is not None else None
        for x in make_inputs(op, t, n, c, act, variant, device)
    ]
    out: dict[str, Callable[[], object]] = {}
    if "fwd" in directions(key):

        def fwd():
            with torch.no_grad():
                return fn(*inputs)

        out["fwd"] = fwd
    if "bwd" in directions(key):
        out["bwd"] = backward_fn(fn, inputs)
    return out


def summary(rows: list[dict]) -> str:
    """Markdown: per (key, direction) the default's time (GPU busy time where the rows have it, else
    back-to-back; the default is the first candidate of the tile key, `*_occupancy` keys included:
    their baseline is the unhinted default), the fastest candidate and its speed-up over the default
    ("-" when the default did not run); failures (errors, and results the reference check refused)
    are counted."""
    groups: dict[tuple[str, str], list[dict]] = {}
    failed: dict[str, set[str]] = {}  # per key, the candidates (tiles) with an error or a refused result
    default_ms: dict[tuple[str, str], float] = {}
    for r in rows:
        if "error" in r or r.get("check") == "fail":  # a candidate that computes something else is no winner
            failed.setdefault(r["key"], set()).add(r["tiles"])
            continue
        groups.setdefault((r["key"], r["direction"]), []).append(r)
        base_key = tile_key(r["key"])
        if (
            r["key"] == base_key
            and base_key in CANDIDATES
            and adopt.names_candidate(base_key, r["tiles"], CANDIDATES[base_key][0])
        ):
            default_ms[(base_key, r["direction"])] = adopt.rank_ms(r)
    out = [
        "| key | dir | default ms | fastest | ms | GB/s | speed-up | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (key, direction), rs in groups.items():
        best = min(rs, key=adopt.rank_ms)
        base = default_ms.get((tile_key(key), direction))
        base_s, gain = ("-", "-") if base is None else (f"{base:.4f}", f"{base / adopt.rank_ms(best):.2f}x")
        out.append(
            f"| {key} | {direction} | {base_s} | {best['tiles']} | {adopt.rank_ms(best):.4f} | "
            f"{best['gb_per_s']:.0f} | {gain} | {len(failed.get(key, ()))} |"
        )
    out += [
        f"| {key} | - | - | all {len(k)} candidates failed | - | - | - | {len(k)} |"
        for key, k in failed.items()
        if not any(g[0] == key for g in groups)
    ]
    return "\n".join(out)


def _read_sweep(path: str, flag: str) -> dict | None:
    """A sweep's `--out` file, checked (`adopt.check_sweep`); None after printing why not."""
    try:
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        adopt.check_sweep(data, path)
    except (OSError, ValueError) as exc:
        print(
            f"sweep {flag}: " + (f"{path}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)),
            file=sys.stderr,
        )
        return None
    changed = regrade(data)
    if changed:
        print(
            f"sweep {flag}: {path}: {len(changed)} row(s) refused by this version's check bounds: "
            + "; ".join(changed[:4])
            + (" ..." if len(changed) > 4 else ""),
            file=sys.stderr,
        )
    return data


def regrade(data: dict) -> list[str]:
    """Refuse (`check` "fail") each timed row of a checked sweep file (`data`, changed in place) whose
    `max_rel_err` is beyond `sweep_check.check_rtol` at the file's activation dtype, so that a bound
    tightened since the sweep ran applies to its file too; one line per changed row. Never the other
    way: a recorded "fail" stays (the file's errors are rounded to 3 digits, and a loosened bound is
    no reason to trust an old refusal less). Rows without a numeric `max_rel_err`, and files without
    a `dtype` of bf16 / fp32, keep what they recorded."""
    act = ACT_DTYPES.get(data.get("dtype"))
    changed = []
    for r in data["rows"]:
        err = r.get("max_rel_err")
        if act is None or "error" in r or isinstance(err, bool) or not isinstance(err, int | float):
            continue
        new = grade(r["key"], act, float(err))
        if r.get("check", "ok") == "ok" and new == "fail":
            changed.append(f"{r['key']} {r['tiles']} {r['direction']}: {r.get('check')} -> {new} ({err:.2g})")
            r["check"] = new
    return changed


def _print_summary(path: str) -> int:
    data = _read_sweep(path, "--summary")
    if data is None:
        return 2
    rows = data["rows"]
    if not rows:
        print(f"sweep --summary: {path}: no rows (the sweep timed nothing)", file=sys.stderr)
        return 1
    timing = (
        "GPU busy ms"
        if all("device_ms" in r for r in rows if "error" not in r)
        else "ms: GPU busy where timed, else pipelined"
    )
    print(
        f"{data.get('device', '?')}: T={data.get('tokens')} n={data.get('n')} C={data.get('hidden')} "
        f"{data.get('dtype')} {data.get('variant')} ({timing}; the first candidate is the default)"
    )
    print(summary(rows))
    return 0


def _adopt(path: str, out: str | None, min_gain: float) -> int:
    if not out:
        print("sweep --adopt: give the tuning file to write with --out", file=sys.stderr)
        return 2
    data = _read_sweep(path, "--adopt")
    if data is None:
        return 2
    try:
        tuned, lines = adopt.from_sweep(data, CANDIDATES, min_gain=min_gain, source=out, sweep=path)
    except ValueError as exc:
        print(f"sweep --adopt: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if not tuned.tiles and not tuned.occupancy:
        ok = sum(r.get("check") == "ok" for r in data["rows"])
        print(
            f"sweep --adopt: nothing adopted ({len(data['rows'])} rows, {ok} passed their check): {out} not written",
            file=sys.stderr,
        )
        return 1
    done = (
        f"wrote {tuning.describe(tuned)}; ship it as mhc_core/kernels/cutile/tuned/"
        f"{tuning.device_slug(tuned.device)}.json"
    )
    try:
        tuning.save(tuned, out)
    except OSError as exc:
        print(f"sweep --adopt: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(done)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--iterations", type=int, default=20, help="Sinkhorn iterations")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--keys", default=",".join(CANDIDATES), help=f"comma-separated, from {', '.join(CANDIDATES)}"
    )
    p.add_argument("--index", type=int, help="only candidate INDEX of each key (0-based)")
    p.add_argument(
        "--warm-only", action="store_true", help="run each candidate once (JIT compile), no timing"
    )
    p.add_argument("--out", help="write the rows as JSON here (with --adopt: the tuning file)")
    p.add_argument("--list", action="store_true", help="print 'key index' per candidate and exit")
    reading = p.add_mutually_exclusive_group()
    reading.add_argument(
        "--summary", metavar="SWEEP_JSON", help="print the fastest candidate per key of a sweep's --out file"
    )
    reading.add_argument(
        "--adopt",
        metavar="SWEEP_JSON",
        help="write the winners of a sweep's --out file that passed their check as a tuning file to --out",
    )
    p.add_argument(
        "--min-gain", type=float, default=1.03, help="--adopt: speed-up over the default a winner needs"
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="run on the CPU kernel interpreter (no GPU; checks the tool, its times mean nothing)",
    )
    args = p.parse_args(argv)
    if args.summary:
        return _print_summary(args.summary)
    if args.adopt:
        return _adopt(args.adopt, args.out, args.min_gain)
    if args.list:
        for key, cands in CANDIDATES.items():
            for i in range(len(cands)):
                print(key, i)
        return 0

    if args.emulate:  # the CPU kernel interpreter: the whole loop without a GPU (tests; times mean nothing)
        from mhc_core.kernels.cutile import CuTileBackend
        from mhc_core.kernels.dispatch import bound_ops
        from tools.cutile.emulator import EmulatedRuntime

        ops, device, device_name = (
            bound_ops(CuTileBackend(EmulatedRuntime(num_sms=4))),
            "cpu",
            "CPU kernel interpreter",
        )
    else:
        cutile = cutile_or_none("sweep")
        if cutile is None:
            return 2
        from mhc_core.kernels.dispatch import bound_ops

        ops, device, device_name = bound_ops(cutile.CUTILE), "cuda", None
    keys = args.keys.split(",")
    unknown = [k for k in keys if k not in CANDIDATES]
    if unknown:
        p.error(f"--keys: unknown {', '.join(unknown)}; valid: {', '.join(CANDIDATES)}")
    act = ACT_DTYPES[args.dtype]
    t, n, c = args.tokens, args.n, args.hidden
    rows = []
    for key in keys:
        cands = CANDIDATES[key]
        if args.index is not None:
            if not 0 <= args.index < len(cands):
                p.error(f"--index {args.index}: {key} has {len(cands)} candidates")
            cands = cands[args.index : args.index + 1]
        for cand in cands:
            label = f"{key}={cand}"
            try:
                with tiling.tuned(None), tiling.overridden(**override(key, cand)):
                    errors = (
                        {}
                        if args.warm_only
                        else deviation(ops, key, t, n, c, act, args.variant, args.iterations, device)
                    )
                    fns = timers(ops, key, t, n, c, act, args.variant, args.iterations, device)
                    for direction, fn in fns.items():
                        if args.warm_only:
                            fn()
                            if device == "cuda":
                                torch.cuda.synchronize()
                            print(f"warm {label} {direction}", flush=True)
                            continue
                        piped = pipelined_ms(fn, args.iters, device)
                        single = time_ms(fn, 0, args.iters, device)
                        try:
                            busy_s = device_busy_seconds(fn, device, calls=5)
                        except RuntimeError as exc:  # no CUPTI: rank by the back-to-back time instead
                            busy_s, device_error = None, f"{type(exc).__name__}: {exc}"[:200]
                        else:
                            device_error = None if busy_s is not None else f"no GPU busy time on {device}"
                        busy_ms = None if busy_s is None else busy_s * 1e3
                        model = bytes_moved(
                            op_of(key),
                            direction,
                            tokens=t,
                            n=n,
                            hidden=c,
                            act_bytes=act.itemsize,
                            with_bias=op_of(key) == "h_post_bda",
                        ).total
                        err = errors[direction]
                        row = {
                            "key": key,
                            "tiles": repr(cand),
                            "direction": direction,
                            "single_ms": round(single, 4),
                            "pipelined_ms": round(piped, 4),
                            "max_rel_err": err if err == float("inf") else float(f"{err:.3g}"),
                            "check": grade(key, act, err),
                        }
                        row.update(
                            {"device_error": device_error}
                            if busy_ms is None
                            else {"device_ms": round(busy_ms, 4)}
                        )
                        row["gb_per_s"] = round(model / (adopt.rank_ms(row) * 1e6), 1)
                        rows.append(row)
                        busy = "-" if busy_ms is None else f"{busy_ms:8.4f} ms"
                        print(
                            f"{label:60s} {direction} single {single:8.4f} ms  pipelined {piped:8.4f} ms "
                            f"GPU busy {busy} {row['gb_per_s']:8.1f} GB/s  check {row['check']} ({err:.2g})",
                            flush=True,
                        )
            except Exception as exc:  # a candidate that does not compile or spills is a result too
                rows.append({"key": key, "tiles": repr(cand), "error": f"{type(exc).__name__}: {exc}"[:400]})
                print(f"{label:60s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            if args.out and not args.warm_only:  # after every candidate: a timeout keeps what was timed
                write_json(
                    args.out,
                    {
                        "tokens": t,
                        "n": n,
                        "hidden": c,
                        "dtype": args.dtype,
                        "variant": args.variant,
                        "device": device_name or torch.cuda.get_device_name(),
                        "rows": rows,
                    },
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
