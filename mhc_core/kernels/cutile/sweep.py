"""Tile-size sweep of the cuTile kernels (GPU only): time each candidate through the real wrappers.

    python -m mhc_core.kernels.cutile.sweep --tokens 8192 --hidden 4096 --n 4 --dtype bf16 --out sweep.json
    python -m mhc_core.kernels.cutile.sweep --keys sinkhorn,mapping --warm-only   # JIT-compile only

Each candidate replaces one `tiling` choice (`tiling.overridden`) and times the op it drives:
`*_fwd` keys the forward, `*_bwd` keys the backward alone (replayed on a retained graph), and
`sinkhorn` (one tile for both) both directions. Per row: the median of single
CUDA-event-timed calls (`single_ms`, CPU launch cost included when the GPU waits for it), the mean
of back-to-back calls (`pipelined_ms`: the kernel's own time only when the GPU is the slower side;
for small ops it is the host's time per call), the GPU busy time per call of 5 profiled calls
(`device_ms`, `mhc_core.kernels.device_time`: the kernels alone, what candidates are ranked by)
and GB/s of that time against `mhc_core.analysis.bytes_moved`, and whether the candidate computes
what the reference does on the same inputs (`max_rel_err`: the largest relative Frobenius error
over outputs, or over input gradients for the backward; `check` ok within `CHECK_RTOL`). The first
candidate of each key is the heuristic's default; the sweep times under `tiling.tuned(None)`, so a
shipped tuning does not change what "default" means. `--warm-only` runs each candidate once (JIT compile into the on-disk
cache), so several processes can compile disjoint `--keys` / `--index` in parallel before one
timing run (`python -m mhc_core.kernels.cutile.sweep --list` prints the `key index` pairs).
`--summary sweep.json` (no GPU) prints, per key and direction, the default's time, the fastest
candidate and the speed-up; `--adopt sweep.json --out tuning.json` (no GPU) writes the winners
that passed their check as a tuning file (`mhc_core.kernels.cutile.tuning`), which
`MHC_CUTILE_TUNING` or a copy into `tuned/` puts in force. `--emulate` runs the same loop on
the CPU kernel interpreter (host-clock times that mean nothing; the tests check the tool with it).
Benchmarks measure; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

from mhc_core import ops as ref
from mhc_core.analysis import bytes_moved
from mhc_core.kernels.cutile import tiling, tuning
from mhc_core.kernels.cutile.bench import (
    add_shape_args,
    backward_fn,
    cutile_or_none,
    make_inputs,
    op_call,
    pipelined_ms,
    time_ms,
    write_json,
)
from mhc_core.kernels.device_time import device_busy_seconds

__all__ = ["CANDIDATES", "CHECK_RTOL", "main", "timers", "deviation", "override", "summary"]

_S = tiling.StreamTiles
CANDIDATES: dict[str, tuple] = {
    "sinkhorn": (tiling.SinkhornTiles(64), tiling.SinkhornTiles(8), tiling.SinkhornTiles(32, True),
                 tiling.SinkhornTiles(64, True), tiling.SinkhornTiles(128, True), tiling.SinkhornTiles(256, True),
                 tiling.SinkhornTiles(64, True, True), tiling.SinkhornTiles(128, True, True),
                 tiling.SinkhornTiles(64, per_element=True), tiling.SinkhornTiles(128, per_element=True),
                 tiling.SinkhornTiles(256, per_element=True),
                 tiling.SinkhornTiles(128, recompute=True, per_element=True),
                 *(tiling.SinkhornTiles(b, per_element=True, approx_div=True) for b in (32, 64, 128)),
                 tiling.SinkhornTiles(128, recompute=True, per_element=True, approx_div=True)),
    # `mma` forwards: whole tiles in and out by TMA, the stream sum on the tensor cores (sm_90: 8-9 TMA
    # loads, 2-4 TMA stores, no shuffles, 0-8 shared loads / stores, no spills; the per-stream
    # defaults: 16-26 plain loads, h_post_bda 88 shared stores).
    "h_aggregate_fwd": (_S(8, 256, True), _S(4, 512, True), _S(4, 256, True), _S(16, 128, True), _S(2, 512),
                        _S(8, 256, True, True), _S(4, 256, True, True), _S(16, 256, True, True), _S(8, 512, True, True),
                        _S(8, 256, mma=True), _S(8, 256, loop_c=True, mma=True), _S(16, 128, mma=True),
                        _S(16, 256, loop_c=True, mma=True)),
    # `mma`: the channel sum x2 @ go^T on the tensor cores; 16 x 128: 4 SHFL / 4 LDS against the
    # default's 80 / 32, no spills (8 x 256 spills, left out).
    "h_aggregate_bwd": (_S(8, 256), _S(4, 256), _S(8, 512), _S(16, 256), _S(16, 128, mma=True),
                        _S(8, 128, mma=True)),
    "h_post_bda_fwd": (_S(4, 256, True), _S(2, 256, True), _S(4, 128, True), _S(2, 512, True), _S(4, 256),
                       _S(4, 256, 2), _S(8, 256, 2), _S(8, 128, 2), _S(4, 256, 2, True), _S(8, 256, 2, True),
                       _S(4, 256, True, True), _S(4, 256, mma=True), _S(4, 256, loop_c=True, mma=True),
                       _S(8, 128, mma=True), _S(8, 256, loop_c=True, mma=True)),
    "h_post_bda_bwd": (_S(32, 64), _S(64, 32), _S(16, 64), _S(32, 64, True), _S(16, 64, True),
                       _S(16, 128, True), _S(8, 128, True), _S(8, 64, 2), _S(4, 64, 2), _S(8, 32, 2),
                       _S(4, 128, 2), _S(8, 64, mma=True), _S(8, 128, mma=True), _S(16, 64, mma=True),
                       _S(4, 128, mma=True), _S(16, 128, mma=True)),
    "mapping_fwd": (tiling.MappingTiles(64, 128), tiling.MappingTiles(128, 64), tiling.MappingTiles(128, 128),
                    tiling.MappingTiles(64, 256)),
    # The dx/dW loop spills at the 32 x 128 default (sm_90: 536 B of stack, 193 STL, 152 LDL per
    # block's code; `resources`); 16 x 64 compiles without spills in bf16 and fp32, 64 x 64, 16 x 256
    # and 32 x 32 in bf16. 64 x 128 (1.70 ms) and larger tiles (3-5 ms) lost on the H200 on 11-29.
    "mapping_bwd": (tiling.MappingTiles(32, 128), tiling.MappingTiles(16, 64), tiling.MappingTiles(64, 64),
                    tiling.MappingTiles(16, 256), tiling.MappingTiles(32, 32), tiling.MappingTiles(32, 64),
                    tiling.MappingTiles(16, 128), tiling.MappingTiles(16, 64, True), tiling.MappingTiles(32, 64, True),
                    tiling.MappingTiles(32, 128, True)),
}


def _hinted(key: str, occupancies: tuple[int, ...], tiles=None) -> tuple[dict, ...]:
    """Override dicts: `key`'s kernels with each occupancy hint, with `tiles` (default: the heuristic's)."""
    base = {} if tiles is None else {key: tiles}
    return tuple({**base, "occupancy": {k: occ for k in tiling.KERNELS_OF[key]}} for occ in occupancies)


for _key in ("h_aggregate_fwd", "h_aggregate_bwd", "h_post_bda_fwd", "h_post_bda_bwd", "mapping_fwd", "mapping_bwd",
             "sinkhorn"):
    # The same op with its default tiles and the occupancy hint on its kernels (2, 4, 8 CTAs per SM).
    CANDIDATES[f"{_key}_occupancy"] = _hinted(_key, (2, 4, 8))
# The tuple-of-streams h_post_bda backward compiles to 255 registers x 256 threads (1 CTA per SM) unhinted,
# 128 at occupancy 2 and 64 at 4, without spills (`resources --occupancy`).
CANDIDATES["h_post_bda_bwd_occupancy"] += _hinted("h_post_bda_bwd", (2, 4), _S(8, 64, 2)) + _hinted(
    "h_post_bda_bwd", (4,), _S(16, 64, 2))
# So does the tensor-core (`mma`) h_post_bda backward: 255 x 256 unhinted, 128 / 64 registers at occupancy 2 / 4,
# no spills; shared-memory traffic LDS 321 -> 20, STS 190 -> 50, BAR 109 -> 10 against the default (sm_90).
CANDIDATES["h_post_bda_bwd_occupancy"] += _hinted("h_post_bda_bwd", (2, 4), _S(8, 64, mma=True)) + _hinted(
    "h_post_bda_bwd", (2, 4), _S(8, 128, mma=True))
# And the `mma` forwards (C-looping): 255 x 256 unhinted, 128 / 64 registers at 2 / 4, no spills.
CANDIDATES["h_aggregate_fwd_occupancy"] += _hinted("h_aggregate_fwd", (2, 4), _S(8, 256, loop_c=True, mma=True))
CANDIDATES["h_post_bda_fwd_occupancy"] += _hinted("h_post_bda_fwd", (2, 4), _S(4, 256, loop_c=True, mma=True))
CANDIDATES["h_aggregate_bwd_occupancy"] += _hinted("h_aggregate_bwd", (4,), _S(16, 128, mma=True)) + _hinted(
    "h_aggregate_bwd", (2, 4), _S(8, 128, mma=True))
# The split-dx mapping backward's grad_x kernel also compiles to 255 registers x 256 threads unhinted.
CANDIDATES["mapping_bwd_occupancy"] += _hinted("mapping_bwd", (2, 4), tiling.MappingTiles(32, 128, True))
# Most expected gain first, so that a sweep its timeout cuts short has timed these: the kernels furthest
# from their targets (h_post_bda and mapping backward at ~25 % and ~11 % of copy, Sinkhorn at 2-16x its
# 10 us) before the forwards.
KEY_ORDER = ("h_post_bda_bwd", "mapping_bwd", "sinkhorn", "h_post_bda_fwd", "h_aggregate_fwd",
             "h_post_bda_bwd_occupancy", "mapping_bwd_occupancy", "h_post_bda_fwd_occupancy", "h_aggregate_fwd_occupancy",
             "mapping_fwd", "mapping_fwd_occupancy", "sinkhorn_occupancy", "h_aggregate_bwd", "h_aggregate_bwd_occupancy")
CANDIDATES = {key: CANDIDATES[key] for key in KEY_ORDER}
"""Candidates per `tiling` key (in `KEY_ORDER`): a tile object for that key, or a whole
`tiling.overridden` dict (the `*_occupancy` keys: hints, with the heuristic's or given tiles). The
first candidate of each tile key is the heuristic's choice at n = 4, C >= 256; the second run on
an H200 is in `tiling`'s docstring."""


def _tile_key(key: str) -> str:
    return key.removesuffix("_occupancy")


def override(key: str, cand) -> dict:
    """The `tiling.overridden` keywords of one candidate."""
    return cand if isinstance(cand, dict) else {key: cand}


def _directions(key: str) -> tuple[str, ...]:
    return tiling.directions(_tile_key(key))


def _op(key: str) -> str:
    return _tile_key(key).removesuffix("_fwd").removesuffix("_bwd")


def timers(ops, key: str, t: int, n: int, c: int, act: torch.dtype, variant: str, iterations: int,
           device: str = "cuda") -> dict[str, Callable[[], object]]:
    """`{direction: fn}` timing `key`'s op with the ops bundle `ops`, on fresh inputs."""
    op = _op(key)
    fn = op_call(ops, op, n, variant, iterations)
    inputs = [x.requires_grad_(True) if x is not None else None
              for x in make_inputs(op, t, n, c, act, variant, device)]
    out: dict[str, Callable[[], object]] = {}
    if "fwd" in _directions(key):
        def fwd():
            with torch.no_grad():
                return fn(*inputs)
        out["fwd"] = fwd
    if "bwd" in _directions(key):
        out["bwd"] = backward_fn(fn, inputs)
    return out


CHECK_RTOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}
"""Largest relative Frobenius error a candidate may show against the reference (per activation
dtype): far above rounding (bf16 outputs: ~1e-3 here), far below a wrong result (~1)."""

SMALL_TENSOR = 16
"""Tensors of fewer values (the `[1]` gains' gradients: sums over every token and coefficient whose
value can cancel to near 0, where any rounding is a large relative error: up to 1.4 on the CPU
interpreter in bf16 at T = 40) must be present and finite but are not compared; the parity tests
hold them to a cosine similarity instead (`mhc_core.testing`)."""


def _rel_error(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None:
        return float("inf")
    a, b = a.detach().float(), b.detach().float()
    if not torch.isfinite(a).all():
        return float("inf")
    if b.numel() < SMALL_TENSOR:
        return 0.0
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-30))


def deviation(ops, key: str, t: int, n: int, c: int, act: torch.dtype, variant: str, iterations: int,
              device: str = "cuda") -> dict[str, float]:
    """`{direction: relative error}` of `key`'s op with the ops bundle `ops` against the reference
    ops on the same fresh inputs: the largest over the forward outputs, or (backward) over the
    gradients of every input for the same random output gradients (small tensors: `SMALL_TENSOR`)."""
    op = _op(key)
    fn, ref_fn = op_call(ops, op, n, variant, iterations), op_call(ref, op, n, variant, iterations)
    inputs = [x.requires_grad_(True) if x is not None else None for x in make_inputs(op, t, n, c, act, variant, device)]
    leaves = [x for x in inputs if x is not None]
    got, want = fn(*inputs), ref_fn(*inputs)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    out: dict[str, float] = {}
    if "fwd" in _directions(key):
        out["fwd"] = max(_rel_error(a, b) for a, b in zip(got, want, strict=True))
    if "bwd" in _directions(key):
        grads = [torch.randn_like(w) for w in want]
        g_got = torch.autograd.grad(got, leaves, grads, allow_unused=True)
        g_want = torch.autograd.grad(want, leaves, grads, allow_unused=True)
        out["bwd"] = max(_rel_error(a, b) for a, b in zip(g_got, g_want, strict=True) if b is not None)
    return out


def _ms(row: dict) -> float:
    """What a candidate is ranked by: its GPU busy time (`device_ms`, rows since 11-30), else the
    back-to-back time, which equals the host's time per call whenever the host is the slower side
    (the 11-29 Sinkhorn rows: 42-46 us for every TILE_B)."""
    return row.get("device_ms", row["pipelined_ms"])


def summary(rows: list[dict]) -> str:
    """Markdown: per (key, direction) the default's time (GPU busy time where the rows have it, else
    back-to-back; the default is the first candidate of the tile key, `*_occupancy` keys included:
    their baseline is the unhinted default), the fastest candidate and its speed-up over the default
    ("-" when the default did not run); failures (errors, and results the reference check refused)
    are counted."""
    groups: dict[tuple[str, str], list[dict]] = {}
    failed: dict[str, int] = {}
    default_ms: dict[tuple[str, str], float] = {}
    for r in rows:
        if "error" in r or r.get("check") == "fail":  # a candidate that computes something else is no winner
            failed[r["key"]] = failed.get(r["key"], 0) + 1
            continue
        groups.setdefault((r["key"], r["direction"]), []).append(r)
        tile_key = _tile_key(r["key"])
        if r["key"] == tile_key and r["tiles"] == repr(CANDIDATES.get(tile_key, (None,))[0]):
            default_ms[(tile_key, r["direction"])] = _ms(r)
    out = ["| key | dir | default ms | fastest | ms | GB/s | speed-up | failed |", "|---|---|---|---|---|---|---|---|"]
    for (key, direction), rs in groups.items():
        best = min(rs, key=_ms)
        base = default_ms.get((_tile_key(key), direction))
        base_s, gain = ("-", "-") if base is None else (f"{base:.4f}", f"{base / _ms(best):.2f}x")
        out.append(f"| {key} | {direction} | {base_s} | {best['tiles']} | {_ms(best):.4f} | "
                   f"{best['gb_per_s']:.0f} | {gain} | {failed.get(key, 0)} |")
    out += [f"| {key} | - | - | all {k} candidates failed | - | - | - | {k} |" for key, k in failed.items()
            if not any(g[0] == key for g in groups)]
    return "\n".join(out)


def _print_summary(path: str) -> int:
    try:
        with open(path) as f:
            data = json.load(f)
        rows = data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"sweep --summary: cannot read the rows of {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    timing = "GPU busy ms" if all("device_ms" in r for r in rows if "error" not in r) else "ms: GPU busy where timed, else pipelined"
    print(f"{data.get('device', '?')}: T={data.get('tokens')} n={data.get('n')} C={data.get('hidden')} "
          f"{data.get('dtype')} {data.get('variant')} ({timing}; the first candidate is the default)")
    print(summary(rows))
    return 0


def _adopt(path: str, out: str | None, min_gain: float) -> int:
    if not out:
        print("sweep --adopt: give the tuning file to write with --out", file=sys.stderr)
        return 2
    try:
        with open(path) as f:
            data = json.load(f)
        tuned, lines = tuning.from_sweep(data, CANDIDATES, min_gain=min_gain, source=out)
    except (OSError, ValueError) as exc:
        print(f"sweep --adopt: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    tuning.save(tuned, out)
    print(f"wrote {tuning.describe(tuned)}; ship it as mhc_core/kernels/cutile/tuned/"
          f"{tuning.device_slug(tuned.device)}.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--iterations", type=int, default=20, help="Sinkhorn iterations")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--keys", default=",".join(CANDIDATES), help=f"comma-separated, from {', '.join(CANDIDATES)}")
    p.add_argument("--index", type=int, help="only candidate INDEX of each key (0-based)")
    p.add_argument("--warm-only", action="store_true", help="run each candidate once (JIT compile), no timing")
    p.add_argument("--out", help="write the rows as JSON here (with --adopt: the tuning file)")
    p.add_argument("--list", action="store_true", help="print 'key index' per candidate and exit")
    p.add_argument("--summary", metavar="SWEEP_JSON", help="print the fastest candidate per key of a sweep's --out file")
    p.add_argument("--adopt", metavar="SWEEP_JSON",
                   help="write the winners of a sweep's --out file that passed their check as a tuning file to --out")
    p.add_argument("--min-gain", type=float, default=1.03, help="--adopt: speed-up over the default a winner needs")
    p.add_argument("--emulate", action="store_true",
                   help="run on the CPU kernel interpreter (no GPU; checks the tool, its times mean nothing)")
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
        from mhc_core.kernels.cutile.ops import make_ops
        from mhc_core.kernels.cutile.runtime import EmulatedRuntime

        ops, device, device_name = make_ops(EmulatedRuntime(num_sms=4)), "cpu", "CPU kernel interpreter"
    else:
        cutile = cutile_or_none("sweep")
        if cutile is None:
            return 2
        ops, device, device_name = cutile.OPS, "cuda", None
    keys = args.keys.split(",")
    unknown = [k for k in keys if k not in CANDIDATES]
    if unknown:
        p.error(f"--keys: unknown {', '.join(unknown)}; valid: {', '.join(CANDIDATES)}")
    act = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t, n, c = args.tokens, args.n, args.hidden
    rows = []
    for key in keys:
        cands = CANDIDATES[key]
        if args.index is not None:
            if not 0 <= args.index < len(cands):
                p.error(f"--index {args.index}: {key} has {len(cands)} candidates")
            cands = cands[args.index:args.index + 1]
        for cand in cands:
            label = f"{key}={cand}"
            try:
                with tiling.tuned(None), tiling.overridden(**override(key, cand)):
                    errors = {} if args.warm_only else deviation(ops, key, t, n, c, act, args.variant,
                                                                 args.iterations, device)
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
                        model = bytes_moved(_op(key), direction, tokens=t, n=n, hidden=c, act_bytes=act.itemsize,
                                            with_bias=_op(key) == "h_post_bda").total
                        err = errors[direction]
                        row = {"key": key, "tiles": repr(cand), "direction": direction,
                               "single_ms": round(single, 4), "pipelined_ms": round(piped, 4),
                               "max_rel_err": err if err == float("inf") else float(f"{err:.3g}"),
                               "check": "ok" if err <= CHECK_RTOL[act] else "fail"}
                        row.update({"device_error": device_error} if busy_ms is None else {"device_ms": round(busy_ms, 4)})
                        row["gb_per_s"] = round(model / (_ms(row) * 1e6), 1)
                        rows.append(row)
                        busy = "-" if busy_ms is None else f"{busy_ms:8.4f} ms"
                        print(f"{label:60s} {direction} single {single:8.4f} ms  pipelined {piped:8.4f} ms "
                              f"GPU busy {busy} {row['gb_per_s']:8.1f} GB/s  check {row['check']} ({err:.2g})",
                              flush=True)
            except Exception as exc:  # a candidate that does not compile or spills is a result too
                rows.append({"key": key, "tiles": repr(cand), "error": f"{type(exc).__name__}: {exc}"[:400]})
                print(f"{label:60s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            if args.out and not args.warm_only:  # after every candidate: a timeout keeps what was timed
                write_json(args.out, {"tokens": t, "n": n, "hidden": c, "dtype": args.dtype, "variant": args.variant,
                                       "device": device_name or torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
