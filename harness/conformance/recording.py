"""Record any peer on the conformance checks' seeded inputs (numbers, not code), for replay where it cannot run.

    python -m harness.conformance.recording --peer te_triton --transformer-engine TREE \\
        --repository NVIDIA/TransformerEngine --branch main --out harness/conformance/recorded/te_triton.json

A recording holds, per check id, the digest of the inputs and the outputs and gradients the peer
returned (a check that raised: its message), and where it came from: repository, branch, commit, the
sha256 of the files that ran, torch, Python, the device, the command, and for Triton kernels run through
the interpreter the triton version and `TRITON_INTERPRET`. `harness.conformance.replay` replays it as `<peer>[recorded]`. Upstream Megatron-LM's
recorder (`harness.conformance.record_megatron_lm`) writes the same format from a tree's own process.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from harness.conformance.checks import (
    check_specs,
    inputs_digest,
    run_side,
    single_pass_stack_source,
    stack_source,
)
from harness.conformance.replay import FORMAT, tensor_to_json
from harness.golden.provenance import utc_now
from harness.peers.base import FromInstalledFiles, FromSourceTree, Peer

__all__ = ["RECORDED_SUFFIX", "main", "record_peer", "write_recording"]

RECORDED_SUFFIX = "[recorded]"
"""Appended to a live peer's name in its recording (`te_triton` -> `te_triton[recorded]`)."""


def record_peer(peer: Peer, *, name: str | None = None) -> dict[str, Any]:
    """The recording entry of `peer`: its fields and every check of its ops (see the module docstring); a peer
    that cannot run here is recorded with its reason (`skipped`) and no checks."""
    checks = {}
    skipped = peer.unavailable()
    chained = stack_source(peer) == "chained"  # its layers chained by the suite: recorded as such
    sp_chained = single_pass_stack_source(peer) == "chained"
    for spec in [] if skipped else check_specs(peer):
        if spec.op not in peer.ops and not (
            (spec.op == "stack" and chained) or (spec.op == "single_pass_stack" and sp_chained)
        ):
            continue
        entry: dict[str, Any] = {"inputs_sha256": inputs_digest(spec)}
        try:
            outputs, grads = run_side(peer, spec, spec.dtype)
        except Exception as exc:  # recorded, so that the matrix shows what the peer raised
            entry["error"] = f"{type(exc).__name__} in {spec.op}: {exc}"
        else:
            entry["outputs"] = {k: tensor_to_json(v, spec.dtype) for k, v in outputs.items()}
            entry["grads"] = {k: tensor_to_json(v, spec.dtype) for k, v in grads.items()}
        checks[spec.id] = entry
    return {
        "name": name or peer.name,
        "description": peer.description,
        "claims": peer.claims,
        "ops": sorted({*peer.ops, *(("stack",) if chained else ())}),
        **({"stack_chained": True} if chained else {}),
        "dtypes": [str(d).removeprefix("torch.") for d in peer.dtypes],
        "streams": list(peer.streams),
        "differences": dict(peer.differences),
        "checks": checks,
        **({"skipped": skipped} if skipped else {}),
    }


def write_recording(doc: dict[str, Any], path: Path) -> None:
    """Write `doc` to `path` atomically (a temporary file beside it, then a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n", encoding="utf-8")
    tmp.replace(path)


def _triton() -> dict[str, str | None]:
    try:
        version = md.version("triton")
    except md.PackageNotFoundError:
        return {}
    return {"triton": version, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}


def _jax() -> dict[str, str]:
    """JAX's version where a JAX peer ran (`jax` imported)."""
    return {"jax": md.version("jax")} if "jax" in sys.modules else {}


def _tree_source(peer: Peer) -> dict[str, Any]:
    """The commit and file hashes of a peer that runs from a source tree (`tree` field), the package version and
    file hashes of one that runs an installed distribution's files (`files()`), else `{}`."""
    if isinstance(peer, FromInstalledFiles):
        installed = peer.files()
        return {"package": installed.describe(), "files_sha256": installed.hashes()}
    if not isinstance(peer, FromSourceTree) or peer.tree is None:
        return {}
    src = peer.source_tree()
    return {"commit": src.commit(), "files_sha256": src.hashes()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", required=True, help="a peer of the registry (e.g. te_triton, torchtitan)")
    p.add_argument(
        "--transformer-engine", type=Path, default=None, metavar="PATH", help="a TransformerEngine tree"
    )
    p.add_argument("--torchtitan", type=Path, default=None, metavar="PATH", help="a torchtitan tree")
    p.add_argument(
        "--megatron-lm",
        type=Path,
        default=None,
        metavar="PATH",
        help="a Megatron-LM tree with experimental/lite (the megatron_lite peer)",
    )
    p.add_argument("--repository", required=True, help="where the peer's code comes from (owner/name)")
    p.add_argument("--branch", default=None, help="the branch or pull request the tree is")
    p.add_argument(
        "--commit", default=None, help="the tree's commit (default: git rev-parse HEAD in the tree)"
    )
    p.add_argument("--out", required=True, type=Path, help="the recording (JSON)")
    args = p.parse_args(argv)
    from harness.conformance.registry import select

    try:
        (peer,) = select(
            [args.peer],
            transformer_engine=args.transformer_engine,
            torchtitan=args.torchtitan,
            megatron_lite=args.megatron_lm,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    why = peer.unavailable()
    if why:
        print(f"error: {peer.name} cannot run here: {why}", file=sys.stderr)
        return 2
    # Placeholders and the file's name only: a path of the recording machine means nothing elsewhere.
    command = shlex.join(
        [
            "python",
            "-m",
            "harness.conformance.recording",
            "--peer",
            args.peer,
            *(["--transformer-engine", "<tree>"] if args.transformer_engine else []),
            *(["--torchtitan", "<tree>"] if args.torchtitan else []),
            *(["--megatron-lm", "<tree>"] if args.megatron_lm else []),
            "--repository",
            args.repository,
            *(["--branch", args.branch] if args.branch else []),
            "--out",
            args.out.name,
        ]
    )
    tree = _tree_source(peer)
    source = {
        "repository": args.repository,
        "branch": args.branch or "?",
        "commit": args.commit or tree.get("commit"),
        **({"package": tree["package"]} if "package" in tree else {}),
        "files_sha256": tree.get("files_sha256", {}),
        "recorded": utc_now(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        **_jax(),
        **(_triton() if "interpreted" in (peer.version() or "") else {}),
        "command": command,
    }
    doc: dict[str, Any] = {
        "format": FORMAT,
        "source": source,
        "peers": [record_peer(peer, name=peer.name + RECORDED_SUFFIX)],
    }
    write_recording(doc, args.out)
    checks = doc["peers"][0]["checks"]
    errors = sum("error" in c for c in checks.values())
    print(
        f"recorded {peer.name} ({source['repository']} {source['branch']}@{source['commit']}): {len(checks)} "
        f"checks, {errors} raised -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
