"""Record upstream Megatron-LM's single-pass mHC on the conformance checks' seeded inputs (numbers, not code).

    python -m harness.conformance.record_single_pass --megatron-lm TREE --single-pass FILE \\
        --file-commit SHA --out harness/conformance/recorded/megatron_lm_single_pass.json

Runs `single_pass_mhc.py` (`FILE`, upstream's file at `--file-commit`) over the tree's `HyperConnectionModule`
(`harness.peers.megatron_single_pass`), on its native ops and with `use_fused_mhc` (the tree's fused kernels:
their torch backend without a GPU, `MHC_FORCE_BACKEND=native`), in this process with the tree's `megatron`
imported first, and writes what it returned per check with where it came from: the tree's commit and the sha256
of its mHC files, the single-pass file's commit and sha256, torch and Python versions, the command. Replayed in
CI as `megatron_lm[single_pass]` and `megatron_lm[single_pass,fused]` (`harness.conformance.replay`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from harness.conformance.recording import record_peer, write_recording
from harness.conformance.replay import FORMAT
from harness.golden.provenance import utc_now
from harness.peers.megatron_lm import TreeError, detect_api, hashes, load_tree
from harness.peers.megatron_single_pass import FILE, MegatronSinglePassPeer
from harness.upstream.megatron_tree import tree_commit

__all__ = ["main", "record"]


def record(tree: Path, file: Path, *, file_commit: str, command: str) -> dict:
    """The recording document (see the module docstring); `TreeError` for a tree that is not dev's generation."""
    if not torch.cuda.is_available():
        os.environ.setdefault("MHC_FORCE_BACKEND", "native")
    api = detect_api(load_tree(tree))
    if api.generation != "dev":
        raise TreeError(
            f"--megatron-lm {tree}: single_pass_mhc.py subclasses the dev generation's HyperConnectionModule "
            f"(its _sinkhorn_op / _h_aggregate_op / _h_post_bda_op); this tree is {api.line()}"
        )
    commit = tree_commit(tree)
    where = f"upstream Megatron-LM single_pass_mhc.py {file_commit[:8]} over dev {str(commit)[:8]}"
    peers = [
        MegatronSinglePassPeer(
            name=f"megatron_lm[single_pass{',fused' if fused else ''}]",
            description=f"{where}, SinglePassHyperConnection"
            + (" with use_fused_mhc (fused_mhc_kernels, torch backend)" if fused else " (native ops)"),
            tree=Path(tree),
            file=Path(file),
            fused=fused,
            commit=file_commit,
        )
        for fused in (False, True)
    ]
    return {
        "format": FORMAT,
        "source": {
            "repository": "NVIDIA/Megatron-LM",
            "branch": "dev",
            "api": api.line(),
            "commit": commit,
            "files_sha256": {**hashes(tree), FILE: hashlib.sha256(Path(file).read_bytes()).hexdigest()},
            "file_commits": {FILE: file_commit},
            "recorded": utc_now(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": command,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "MHC_FORCE_BACKEND": os.environ.get("MHC_FORCE_BACKEND"),
        },
        "peers": [record_peer(p) for p in peers],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM dev tree (d48bd6be's API)")
    p.add_argument("--single-pass", required=True, type=Path, help=f"upstream's {FILE}")
    p.add_argument("--file-commit", required=True, help="the commit the single-pass file is from")
    p.add_argument("--out", required=True, type=Path, help="the recording (JSON)")
    args = p.parse_args(argv)
    if not args.single_pass.is_file():
        print(f"error: --single-pass {args.single_pass}: no such file", file=sys.stderr)
        return 2
    command = shlex.join(
        [
            "python",
            "-m",
            "harness.conformance.record_single_pass",
            "--megatron-lm",
            "<tree>",
            "--single-pass",
            "<single_pass_mhc.py>",
            "--file-commit",
            args.file_commit,
            "--out",
            args.out.name,
        ]
    )
    try:
        doc = record(args.megatron_lm, args.single_pass, file_commit=args.file_commit, command=command)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_recording(doc, args.out)
    errors = sum("error" in c for peer in doc["peers"] for c in peer["checks"].values())
    print(
        f"recorded {', '.join(q['name'] for q in doc['peers'])}: "
        f"{sum(len(q['checks']) for q in doc['peers'])} checks, {errors} raised -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
