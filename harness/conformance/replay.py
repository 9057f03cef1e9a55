"""Recorded peers: another implementation's outputs and gradients on the checks' seeded inputs, replayed.

A recording (`python -m harness.conformance.recording` for any peer, `record_megatron_lm` for a
Megatron-LM tree) holds, per check id, the digest of the
inputs it was made on and the outputs and gradients the implementation returned, plus where it came
from (repository, commit, the sha256 of the source files, torch and Python versions). Replaying it
puts that implementation in the matrix on a machine that cannot run it: upstream Megatron-LM's mHC
is in no released package, so its numbers from `main` and `dev` are committed here as data
(`harness/conformance/recorded/*.json`). A check whose inputs changed since the recording is an error
naming the file and the command that re-records it; so is a check the recording lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.conformance.checks import CheckSpec, inputs_digest
from harness.peers.base import Peer, PeerError

__all__ = [
    "FORMAT",
    "RECORDED_DIR",
    "RecordedPeer",
    "load_recording",
    "recorded_peers",
    "tensor_from_json",
    "tensor_to_json",
]

FORMAT = "mhc-suite conformance recording 1"
RECORDED_DIR = Path(__file__).with_name("recorded")


def tensor_to_json(t: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Shape and values; an fp32 (or lower) result is written with the 9 digits that round-trip it."""
    flat = t.detach().to(torch.float64).flatten().tolist()
    values = flat if dtype == torch.float64 else [float(f"{v:.9g}") for v in flat]
    return {"shape": list(t.shape), "values": values}


def tensor_from_json(doc: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(doc["values"], dtype=torch.float64).reshape(doc["shape"])


@dataclass(frozen=True, kw_only=True)
class RecordedPeer(Peer):
    """A peer replayed from a recording (see the module docstring)."""

    source: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    path: Path = Path()
    skipped: str | None = None
    """Why the peer did not run where it was recorded (its row is then skipped with that reason)."""
    stack_chained: bool = False
    """Its recorded `stack` checks chained its `layer` (it has no stack of its own)."""

    def unavailable(self) -> str | None:
        return None if self.skipped is None else f"not run where recorded: {self.skipped}"

    def version(self) -> str | None:
        """`<branch>@<commit[:12]>` (a package: its name and version), plus `(interpreted)` for Triton kernels
        recorded through the interpreter."""
        commit, branch = self.source.get("commit"), self.source.get("branch")
        if self.source.get("package"):
            where = str(self.source["package"])
        elif commit:
            where = f"{branch}@{commit[:12]}" if branch else commit[:12]
        else:
            where = f"{branch or 'a'} tree {self.source.get('tree', '?')} (no commit)"
        interpreted = self.source.get("TRITON_INTERPRET") == "1" and self.source.get("device") == "cpu"
        return f"{where} (interpreted)" if interpreted else where

    def side(self, spec: CheckSpec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The recorded outputs and gradients of `spec`; `PeerError` naming the file otherwise."""
        rec = self.checks.get(spec.id)
        how = f"re-record with: {_current(self.source.get('command', 'python -m harness.conformance.recording'))}"
        if rec is None:
            raise PeerError(f"{self.path}: {self.name} has no recording of check {spec.id!r}; {how}")
        if "error" in rec:
            raise PeerError(f"{self.name} (recorded) raised: {rec['error']}")
        if rec["inputs_sha256"] != inputs_digest(spec):
            raise PeerError(
                f"{self.path}: check {spec.id!r} was recorded on other inputs (the cases changed "
                f"since {self.source.get('recorded', '?')}); {how}"
            )
        return (
            {k: tensor_from_json(v) for k, v in rec["outputs"].items()},
            {k: tensor_from_json(v) for k, v in rec["grads"].items()},
        )


_MOVED = {"harness.peers.record_megatron_lm": "harness.conformance.record_megatron_lm"}
"""Recorders that moved since a committed recording named them in its `command`."""


def _current(command: str) -> str:
    """`command` with a moved recorder's module under its present name."""
    for old, new in _MOVED.items():
        command = command.replace(old, new)
    return command


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def load_recording(path: Path, *, prefix: str | None = None) -> list[RecordedPeer]:
    """The peers of one recording file; `prefix` renames `megatron_lm[...]` to `<prefix>[...]`."""
    from harness.golden.schema import parse_json

    path = Path(path)
    doc = parse_json(path.read_text(encoding="utf-8"), source=str(path))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not a conformance recording (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
            f"expected {FORMAT!r})"
        )
    out = []
    for p in doc["peers"]:
        name = p["name"] if prefix is None else prefix + p["name"][p["name"].index("[") :]
        out.append(
            RecordedPeer(
                name=name,
                description=f"{p['description']} (recorded)",
                ops=frozenset(p["ops"]),
                dtypes=tuple(_DTYPES[d] for d in p["dtypes"]),
                streams=tuple(p["streams"]),
                differences=p.get("differences", {}),
                claims=p.get("claims"),
                source=doc["source"],
                checks=p["checks"],
                path=path,
                skipped=p.get("skipped"),
                stack_chained=p.get("stack_chained", False),
            )
        )
    return out


def recorded_peers(directory: Path = RECORDED_DIR) -> list[RecordedPeer]:
    """Every committed recording's peers (`megatron_lm[main]`, `megatron_lm[dev]`, ...), sorted by file."""
    out: list[RecordedPeer] = []
    for path in sorted(Path(directory).glob("*.json")):
        out += load_recording(path)
    return out
