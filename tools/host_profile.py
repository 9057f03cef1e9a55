"""Where an op's host time goes: the CPU side of one call, per backend, and a profile of it.

    python -m tools.host_profile --backend cutile --tokens 8192 --hidden 4096 --n 4 --dtype bf16

A kernel that takes 80 us on the GPU can still cost 380 us per call when the host needs longer to
issue it (the cuTile mapping forward on an H200, `docs/measurements/h200-2026-11-30/`). This tool separates the two:
for each op it times the Python call alone on the host clock (forward; backward replayed on a
retained graph), with the device drained between calls and outside the timed span, so a call
never waits on a full launch queue; then it runs the same calls under `cProfile` (the backward on
the calling thread, where the profiler sees it) and reports the
functions with the most own time and the own time per area (`mhc_core`, `torch`, `cuda.tile`
Python code, and C functions: torch's ops, allocations and cuTile's `launch`). On a CPU device the
call's time is its compute (reference, compiled): there the figure is the whole op, not the host's
share. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from mhc_core.kernels import dispatch
from tools.cutile.bench import (
    ACT_DTYPES,
    add_shape_args,
    backward_fn,
    make_inputs,
    op_call,
    write_json,
)

__all__ = [
    "AREAS",
    "FunctionCost",
    "HostProfile",
    "host_us",
    "profile_calls",
    "profile_op",
    "area_of",
    "main",
]

AREAS = ("mhc_core", "torch", "cuda.tile", "C functions", "other")


@dataclass(frozen=True, kw_only=True)
class FunctionCost:
    """One profiled function: its own time per call of the op, in microseconds."""

    name: str
    area: str
    calls_per_op: float
    own_us: float


@dataclass(frozen=True, kw_only=True)
class HostProfile:
    """The host side of one op in one direction (`fwd`, or `bwd` replayed on a retained graph)."""

    op: str
    direction: str
    backend: str
    host_us: float
    """Median host time of one call, device drained before each call and not counted."""
    profiled_us: float
    """Time of one call under cProfile (larger than `host_us`: the profiler's own cost)."""
    area_us: dict[str, float]
    """Own time per area per call under the profiler; sums to about `profiled_us`."""
    top: tuple[FunctionCost, ...]


def _drain(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def host_us(fn: Callable[[], object], *, calls: int, warmup: int, device: str) -> float:
    """Median microseconds of `fn()` on the host clock, the device drained before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        _drain(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    _drain(device)
    return statistics.median(times)


def area_of(filename: str) -> str:
    """The area of a profiled function: where its code lives (`~` is a C function)."""
    if filename == "~":
        return "C functions"
    path = filename.replace("\\", "/")
    for area, marker in (("mhc_core", "/mhc_core/"), ("cuda.tile", "/cuda/tile/"), ("torch", "/torch/")):
        if marker in path:
            return area
    return "other"


def profile_calls(
    fn: Callable[[], object], *, calls: int, device: str, top: int
) -> tuple[float, dict[str, float], tuple[FunctionCost, ...]]:
    """`fn()` `calls` times under cProfile: (us per call, own us per area per call, the `top` functions by
    own time). The device is drained after each call, inside the profile (its wait shows as a C function).
    The backward runs on this thread (`set_multithreading_enabled(False)`): on a GPU autograd would run it
    on a device thread, which the profiler does not see."""
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        start = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            fn()
            _drain(device)
        prof.disable()
    per_call = (time.perf_counter() - start) * 1e6 / calls
    # {(file, line, name): (cc, nc, tottime, cumtime, callers)}: pstats' table, which typeshed does not declare
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    areas = dict.fromkeys(AREAS, 0.0)
    rows = []
    for (filename, line, name), (_, ncalls, tottime, _, _) in stats.items():
        area = area_of(filename)
        areas[area] += tottime * 1e6 / calls
        label = name if filename == "~" else f"{Path(filename).name}:{line}({name})"
        rows.append(
            FunctionCost(name=label, area=area, calls_per_op=ncalls / calls, own_us=tottime * 1e6 / calls)
        )
    rows.sort(key=lambda r: r.own_us, reverse=True)
    return per_call, {k: round(v, 2) for k, v in areas.items()}, tuple(rows[:top])


def profile_op(
    op: str,
    backend: str,
    *,
    tokens: int,
    hidden: int,
    n: int,
    act: torch.dtype,
    variant: str,
    iterations: int,
    device: str,
    calls: int,
    warmup: int,
    top: int,
) -> list[HostProfile]:
    """Forward and backward host profiles of `op` on `backend` (`dispatch.op_on`)."""
    impl = dispatch.op_on(op, backend)
    fn = op_call(SimpleNamespace(**{op: impl}), op, n, variant, iterations)
    inputs = [
        x.requires_grad_(True) if x is not None else None
        for x in make_inputs(op, tokens, n, hidden, act, variant, device=device)
    ]
    out = []
    for direction, call in (("fwd", lambda: fn(*inputs)), ("bwd", backward_fn(fn, inputs))):
        host = host_us(call, calls=calls, warmup=warmup, device=device)
        profiled, areas, top_rows = profile_calls(call, calls=calls, device=device, top=top)
        out.append(
            HostProfile(
                op=op,
                direction=direction,
                backend=backend,
                host_us=round(host, 2),
                profiled_us=round(profiled, 2),
                area_us=areas,
                top=top_rows,
            )
        )
    return out


def _print(rows: list[HostProfile]) -> None:
    for r in rows:
        areas = ", ".join(f"{k} {v:.1f}" for k, v in r.area_us.items() if v > 0)
        print(
            f"{r.op:12s} {r.direction} {r.backend:9s} host {r.host_us:9.1f} us per call "
            f"(profiled {r.profiled_us:.1f} us: {areas})",
            flush=True,
        )
        for f in r.top:
            print(f"    {f.own_us:8.1f} us  {f.calls_per_op:5.1f}x  [{f.area}] {f.name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--backend", choices=dispatch.BACKENDS, default="cutile")
    p.add_argument("--device", default=None, help="default: cuda if a GPU is visible, else cpu")
    p.add_argument("--iterations", type=int, default=20, help="Sinkhorn iterations")
    p.add_argument("--calls", type=int, default=50, help="timed calls, and as many profiled ones")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (the first JIT-compiles)")
    p.add_argument("--top", type=int, default=12, help="functions listed per op and direction")
    p.add_argument("--ops", default="mapping,sinkhorn,h_aggregate,h_post_bda,pre")
    p.add_argument("--out", help="write the profiles as JSON here")
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "n", "iterations", "calls", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be >= 0")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(dispatch.OPS))
    if unknown:
        p.error(f"--ops: unknown {', '.join(unknown)}; valid: {', '.join(dispatch.OPS)}")
    ok, why = dispatch.availability(args.backend, device)
    if not ok:
        print(f"host_profile: backend {args.backend} unavailable on {device}: {why}", file=sys.stderr)
        return 2
    rows = []
    for op in ops:
        rows += profile_op(
            op,
            args.backend,
            tokens=args.tokens,
            hidden=args.hidden,
            n=args.n,
            act=ACT_DTYPES[args.dtype],
            variant=args.variant,
            iterations=args.iterations,
            device=device,
            calls=args.calls,
            warmup=args.warmup,
            top=args.top,
        )
    _print(rows)
    if args.out:
        write_json(
            args.out,
            {
                "tokens": args.tokens,
                "hidden": args.hidden,
                "n": args.n,
                "dtype": args.dtype,
                "variant": args.variant,
                "backend": args.backend,
                "device": device,
                "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                "calls": args.calls,
                "rows": [asdict(r) for r in rows],
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
