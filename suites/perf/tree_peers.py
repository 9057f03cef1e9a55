"""Upstream Megatron-LM's mHC from a source tree, timed beside ours: the perf suite's peer rows for a tree.

    python -m suites.perf.tree_peers --megatron-lm PATH --out results/perf_megatron_lm.json [--smoke]

Runs in a process of its own, under a Python that can import the tree (upstream imports triton: the
compat env's `.tox/compat/bin/python`, or a GPU node's), because the tree's `megatron` must be the one
imported. Upstream's `@torch.compile` methods stay compiled (upstream's own choice, as a user runs them);
dev's fused module runs its torch backend on CPU (`MHC_FORCE_BACKEND=native`, upstream's switch). The process
keeps freed heap buffers as the perf suite's does (`retain_heap`, in `machine_info.mhc`): without it the first
rows paid first-touch page faults the later ones did not (ours 24 against 16 ms on the first row, 2026-12-04).

Per peer of the tree (main's `HyperConnectionModule`; dev's native and fused modules) and per op of
`suites.perf.peers` (`coefficients`: `compute_mappings` + `aggregate`; `layer_mhc`: the module's forward
and `fused_h_res_h_post_bda` for both sublayers, the sublayers the identity), forward and forward +
backward: a conformance check at the shape against our reference in the configuration the peer's `timing`
names (`MegatronLMTreePeer.timed` builds the calls; a tree of neither generation is not timed), then
the peer, a same-bytes copy and ours (compiled, reference) timed rep by rep in alternation. The output is
a pytest-benchmark-shaped JSON (`benchmarks[*].stats` from those samples, `extra_info` as
`test_peers.py` writes it), which `python -m harness.perf.table` and `mhc-harness perf-history` read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from harness.golden.provenance import utc_now
from harness.peers.megatron_lm import (
    MegatronLMTreePeer,
    TreeError,
    hashes,
    load_tree,
    make_peers,
    tree_flavor,
)
from suites.perf.peers import PeerCase, conforms, iterations_for, paired_fns, peer_cases, peer_info
from suites.perf.timing import paired_samples, retain_heap

__all__ = ["main", "tree_rows"]


def _build(peer: MegatronLMTreePeer, case: PeerCase):
    """The tree peer's timed entry point for `case` (`MegatronLMTreePeer.timed`)."""
    return peer.timed(
        case.op, n=case.n, hidden=case.hidden, dtype=case.dtype, iterations=iterations_for(case)
    )


def _cases(smoke: bool) -> list[PeerCase]:
    """The perf suite's CPU peer sizes (fp32 C 1024 and bf16 C 2048 at T 4096), Sinkhorn aside."""
    return [c for c in peer_cases("cpu", smoke_run=smoke) if c.op != "sinkhorn"]


def _stats(samples: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(samples),
        "mean": statistics.fmean(samples),
        "stddev": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "min": min(samples),
        "max": max(samples),
        "rounds": len(samples),
        "iterations": 1,
    }


def tree_rows(tree: Path, *, reps: int, smoke: bool) -> list[dict]:
    """One benchmark entry per peer, op and direction that conforms at its shape (see the module docstring)."""
    tree_flavor(tree)  # a path that is no tree is named first
    if not torch.cuda.is_available():
        os.environ.setdefault("MHC_FORCE_BACKEND", "native")
    os.environ.setdefault(
        "TORCHDYNAMO_DISABLE", "0"
    )  # load_tree would otherwise switch upstream's compile off
    load_tree(tree)
    rows = []
    for peer in make_peers(tree, None):
        if peer.timing is None:
            print(
                f"{peer.name}: its API generation ({peer.api.generation}) has no timed configuration; not timed",
                file=sys.stderr,
            )
            continue
        variant = peer.timing.variant
        for case in _cases(smoke):
            ok, worst = conforms(_build(peer, case), case, variant)
            if not ok:
                print(
                    f"{peer.name} does not conform to {variant} at {case.id} ({worst}); not timed",
                    file=sys.stderr,
                )
                continue
            for direction in ("fwd", "fwdbwd"):
                inputs = case.inputs(requires_grad=direction == "fwdbwd")
                fns = paired_fns(_build(peer, case), case, inputs, direction, variant)
                timed = paired_samples(fns, device=case.device, reps=reps, warmup=2)
                info = peer_info(case, direction, peer.name, variant, timed, f"at {case.id}: {worst}")
                rows.append(
                    {
                        "name": f"test_peer[{case.id}-{direction}-{peer.name}]",
                        "fullname": f"suites/perf/tree_peers.py::test_peer[{case.id}-{direction}-{peer.name}]",
                        "group": f"peer-{case.op}-{direction}",
                        "params": None,
                        "stats": _stats(timed[0]),
                        "extra_info": info,
                    }
                )
                print(
                    f"{peer.name} {case.id} {direction}: peer {info['median_s'] * 1e3:.2f} ms, ours "
                    f"{info['ours_compiled_s'] * 1e3:.2f} ms, ours vs peer {info['speedup_vs_peer']:.2f}x",
                    file=sys.stderr,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM source tree (main or dev)")
    p.add_argument("--out", required=True, type=Path, help="the benchmark JSON to write")
    p.add_argument("--reps", type=int, default=int(os.environ.get("MHC_PERF_REPS", "5")))
    p.add_argument("--smoke", action="store_true", help="T 256 at C 512 fp32 only")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    settings = {
        "malloc_retain": retain_heap(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    try:
        rows = tree_rows(args.megatron_lm, reps=args.reps, smoke=args.smoke)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(
            f"error: --megatron-lm {args.megatron_lm}: no peer of the tree conforms at the timed shapes",
            file=sys.stderr,
        )
        return 1
    doc = {
        "machine_info": {
            "python_version": platform.python_version(),
            "torch": torch.__version__,
            "megatron_lm": {"tree_sha256": hashes(args.megatron_lm)},
            "mhc": settings,
        },
        "commit_info": {},
        "datetime": utc_now(),
        "version": "mhc-suite tree_peers 1",
        "benchmarks": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"{len(rows)} rows -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
