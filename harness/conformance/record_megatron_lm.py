"""Record upstream Megatron-LM's mHC on the conformance checks' seeded inputs (numbers, not code).

    python -m harness.conformance.record_megatron_lm --megatron-lm /path/to/Megatron-LM --out FILE \\
        [--branch main] [--commit SHA] [--backend native|triton]

Runs every check of the tree's peers (`harness.peers.megatron_lm`: main's module, or dev's native
and fused modules) in this process, with the tree's `megatron` imported first, and writes what
upstream returned (outputs and gradients per check, with the digest of the inputs) plus where it came
from: repository, branch, commit (`--commit`, else `git rev-parse HEAD` in the tree), the sha256 of
`hyper_connection.py` and `fused_mhc_kernels.py`, torch and Python versions, the command. A check
that raises is recorded as an error with the message. The committed recordings
(`harness/conformance/recorded/`) were made with this from `main` and `dev` (`docs/conformance.md`).

`--backend triton` (dev only) records the fused module alone on upstream's Triton backend
(`MHC_FORCE_BACKEND=triton`) as `megatron_lm[dev,fused,triton]`; without a GPU its kernels run
through Triton's interpreter (`harness.peers.triton_interpreter`: `TRITON_INTERPRET=1`, autotuners
keep their first configuration).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from harness.conformance.recording import record_peer, write_recording
from harness.conformance.replay import FORMAT
from harness.golden.provenance import utc_now
from harness.peers.megatron_lm import TreeError, hashes, load_tree, make_peers, tree_flavor
from harness.peers.triton_interpreter import interpreted, prepare_interpreter, without_autotune_timing
from harness.upstream.megatron_tree import tree_commit

__all__ = ["main", "record"]


def _triton_peers(peers: list) -> list:
    """dev's fused module on the Triton backend: its kernels' autotuners made interpreter-safe."""
    import megatron.core.fusions.fused_mhc_kernels as kernels

    if not kernels.is_triton_available():
        raise TreeError(
            f"--backend triton: the tree's fused_mhc_kernels has no Triton backend here "
            f"({kernels._mhc_backend_status()[0]})"
        )
    without_autotune_timing(kernels)
    where = "interpreted on CPU" if interpreted() else "on the GPU"
    return [
        dataclasses.replace(
            p,
            name=f"{p.name[:-1]},triton]",
            description=f"{p.description.split(' (')[0]} (fused_mhc_kernels, Triton backend, "
            f"{where}){'; ' + p.api.line() if p.api else ''}",
        )
        for p in peers
        if p.fused
    ]


def record(
    tree: Path, *, branch: str | None, commit: str | None, command: str, backend: str = "native"
) -> dict:
    """The recording document of `tree` (see the module docstring). Without a GPU, dev's fused module runs
    its torch backend (`MHC_FORCE_BACKEND=native`, upstream's own switch; its Triton probe fails on CPU),
    or with `backend="triton"` its Triton backend through the interpreter."""
    flavor = tree_flavor(tree)
    if backend == "triton":
        if flavor != "dev":
            raise TreeError(f"--backend triton: {tree} is a {flavor} tree; only dev has fused Triton kernels")
        why = prepare_interpreter()
        if why:
            raise TreeError(f"--backend triton: {why}")
        os.environ["MHC_FORCE_BACKEND"] = "triton"
    elif not torch.cuda.is_available():
        os.environ.setdefault("MHC_FORCE_BACKEND", "native")
    load_tree(tree)  # a tree that does not import here fails once, with its reason, before any check
    commit = commit or tree_commit(tree)
    made = make_peers(tree, commit, label=branch)
    peers = [record_peer(p) for p in (_triton_peers(made) if backend == "triton" else made)]
    return {
        "format": FORMAT,
        "source": {
            "repository": "NVIDIA/Megatron-LM",
            "branch": branch,
            "api": made[0].api.line() if made[0].api else None,
            "commit": commit,
            # the local path only where nothing else names the tree (no commit)
            **({} if commit else {"tree": str(Path(tree).resolve())}),
            "files_sha256": hashes(tree),
            "recorded": utc_now(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": command,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "MHC_FORCE_BACKEND": os.environ.get("MHC_FORCE_BACKEND"),
            **(
                {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "triton": _triton_version()}
                if backend == "triton"
                else {}
            ),
        },
        "peers": peers,
    }


def _triton_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("triton")
    except md.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM source tree (main or dev)")
    p.add_argument("--out", required=True, type=Path, help="the recording (JSON)")
    p.add_argument(
        "--branch",
        default=None,
        help="the branch the tree is (its peers' label; default: its commit, else its folder's name)",
    )
    p.add_argument(
        "--commit", default=None, help="the tree's commit (default: git rev-parse HEAD in the tree)"
    )
    p.add_argument(
        "--backend",
        choices=("native", "triton"),
        default="native",
        help="dev's fused module: its torch backend (default without a GPU), or Triton alone",
    )
    args = p.parse_args(argv)
    # Placeholders and the file's name only: a path of the recording machine means nothing elsewhere.
    command = shlex.join(
        [
            "python",
            "-m",
            "harness.conformance.record_megatron_lm",
            "--megatron-lm",
            "<tree>",
            "--out",
            args.out.name,
            *(["--branch", args.branch] if args.branch else []),
            *(["--backend", args.backend] if args.backend != "native" else []),
        ]
    )
    try:
        doc = record(
            args.megatron_lm, branch=args.branch, commit=args.commit, command=command, backend=args.backend
        )
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_recording(doc, args.out)
    errors = sum("error" in c for peer in doc["peers"] for c in peer["checks"].values())
    print(
        f"recorded {', '.join(p['name'] for p in doc['peers'])} from {args.megatron_lm} "
        f"({doc['source']['branch'] or 'no branch named'}@{doc['source']['commit']}): "
        f"{sum(len(p['checks']) for p in doc['peers'])} checks, {errors} raised -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
