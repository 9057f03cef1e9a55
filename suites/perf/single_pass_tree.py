"""Upstream's single-pass mHC module timed beside ours: the single-pass perf rows for a Megatron-LM tree.

    python -m suites.perf.single_pass_tree --megatron-lm TREE --single-pass FILE --out results/perf_single_pass.json

Runs upstream's `SinglePassHyperConnection` (`FILE`, `megatron/core/transformer/single_pass_mhc.py`, over the tree's
`HyperConnectionModule`: `harness.peers.megatron_single_pass`) in a process of its own (the tree's `megatron` must be
the one imported), eager and under `torch.compile` (a user's `torch.compile(module)`), at the single-pass perf sizes
(`suites/perf/test_single_pass.py`: T 4096, C 1024 fp32 and C 2048 bf16), forward and forward + backward. Before a
row is timed its outputs are compared with our reference at the size; then upstream eager, upstream compiled,
ours (`single_pass_pre`, compiled backend) and a copy of the same bytes are timed rep by rep in alternation. The
output is pytest-benchmark-shaped JSON (`extra_info`: each median, `speedup_vs_upstream_eager`,
`speedup_vs_upstream_compiled`, `roofline_ratio`), with the tree's and the file's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from harness.golden.provenance import utc_now
from harness.peers.megatron_lm import TreeError, hashes
from harness.peers.megatron_single_pass import FILE, MegatronSinglePassPeer
from mhc_core.testing import tolerance
from suites.perf.test_single_pass import SinglePassCase, _ours, _timed
from suites.perf.timing import copy_fn, paired_samples, retain_heap

__all__ = ["main", "rows"]


def _cases(smoke: bool) -> list[SinglePassCase]:
    if smoke:
        return [SinglePassCase(tokens=256, hidden=256, dtype=torch.float32, iterations=4)]
    return [
        SinglePassCase(tokens=4096, hidden=1024, dtype=torch.float32),
        SinglePassCase(tokens=4096, hidden=2048, dtype=torch.bfloat16),
    ]


def _upstream(peer: MegatronSinglePassPeer, case: SinglePassCase, t: dict, compiled: bool):
    """Upstream's module with the case's parameters bound, called on the case's streams and previous mix."""
    from harness.peers.base import SublayerParams

    params = SublayerParams(
        n=case.n,
        weight=t["weight"],
        alpha_pre=t["alpha_pre"],
        alpha_post=t["alpha_post"],
        alpha_res=t["alpha_res"],
        bias=t["bias"],
    )
    mod = peer._module(case.n, case.hidden, case.iterations, params)
    call = torch.compile(mod) if compiled else mod
    tokens, n = case.tokens, case.n

    def run():
        branch, nxt, post, res = call(
            t["x"].view(tokens, 1, n * case.hidden), t["previous_h_pre"].view(tokens, 1, n)
        )
        return branch.view(tokens, -1), nxt.view(tokens, n), post.view(tokens, n), res.view(tokens, n, n)

    return run


def _conforms(peer: MegatronSinglePassPeer, case: SinglePassCase) -> str | None:
    """None where upstream's outputs match our reference's at `case`, else the worst output."""
    t = case.inputs(requires_grad=False)
    with torch.no_grad():
        got = _upstream(peer, case, t, compiled=False)()
        want = _ours("reference", case, t)()
    tol = tolerance(case.dtype, "fwd")
    for name, a, e in zip(("branch", "next_h_pre", "h_post", "h_res"), got, want, strict=True):
        err = float((a.double() - e.double()).abs().max())
        if err > tol.atol + tol.rtol * float(e.double().abs().max()):
            return f"{name} {err:.3g} off ours at {case.id}"
    return None


def rows(tree: Path, file: Path, *, reps: int, smoke: bool) -> list[dict]:
    """One benchmark entry per case and direction (see the module docstring)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("MHC_FORCE_BACKEND", "native")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "0")  # load_tree would otherwise switch torch.compile off
    peer = MegatronSinglePassPeer(name="megatron_lm[single_pass]", description="", tree=tree, file=file)
    out = []
    for case in _cases(smoke):
        why = _conforms(peer, case)
        if why:
            print(f"upstream's single-pass module does not conform: {why}; not timed", file=sys.stderr)
            continue
        for direction in ("fwd", "fwdbwd"):
            t = case.inputs(requires_grad=direction == "fwdbwd")
            leaves = [t["x"], t["previous_h_pre"], t["weight"], t["bias"]]
            nbytes = case.bytes(direction)
            names = ["ours", "copy", "upstream_eager", "upstream_compiled"]
            fns = [
                _timed(_ours("compiled", case, t), direction, leaves),
                copy_fn(nbytes, device="cpu"),
                _timed(_upstream(peer, case, t, compiled=False), direction, leaves),
                _timed(_upstream(peer, case, t, compiled=True), direction, leaves),
            ]
            samples = paired_samples(fns, device="cpu", reps=reps, warmup=2)
            med = {k: statistics.median(s) for k, s in zip(names, samples, strict=True)}
            info = {
                "op": "single_pass_pre",
                "direction": direction,
                "shape": case.id,
                **{f"{k}_s": v for k, v in med.items()},
                "roofline_ratio": med["copy"] / med["ours"],
                "speedup_vs_upstream_eager": med["upstream_eager"] / med["ours"],
                "speedup_vs_upstream_compiled": med["upstream_compiled"] / med["ours"],
            }
            print(
                f"{case.id} {direction}: ours {med['ours'] * 1e3:.2f} ms, upstream eager "
                f"{med['upstream_eager'] * 1e3:.2f} ms, compiled {med['upstream_compiled'] * 1e3:.2f} ms",
                file=sys.stderr,
            )
            out.append(
                {
                    "name": f"single_pass_tree[{case.id}-{direction}]",
                    "group": f"single_pass_pre-{direction}",
                    "stats": {"median": med["ours"], "rounds": reps, "iterations": 1},
                    "extra_info": info,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM dev tree (d48bd6be's API)")
    p.add_argument("--single-pass", required=True, type=Path, help=f"upstream's {FILE}")
    p.add_argument("--out", required=True, type=Path, help="the benchmark JSON to write")
    p.add_argument("--reps", type=int, default=int(os.environ.get("MHC_PERF_REPS", "5")))
    p.add_argument("--smoke", action="store_true", help="T 256 at C 256 fp32 only")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    settings = {"malloc_retain": retain_heap(), "torch_threads": torch.get_num_threads()}
    try:
        got = rows(args.megatron_lm, args.single_pass, reps=args.reps, smoke=args.smoke)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not got:
        print("error: upstream's single-pass module conforms at no timed size", file=sys.stderr)
        return 1
    doc = {
        "machine_info": {
            "python_version": platform.python_version(),
            "torch": torch.__version__,
            "megatron_lm": {
                "tree_sha256": hashes(args.megatron_lm),
                "single_pass_sha256": hashlib.sha256(args.single_pass.read_bytes()).hexdigest(),
            },
            "mhc": settings,
        },
        "datetime": utc_now(),
        "version": "mhc-suite single_pass_tree 1",
        "benchmarks": got,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"{len(got)} rows -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
