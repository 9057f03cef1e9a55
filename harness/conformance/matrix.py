"""The conformance matrix: every peer x every check, against every variant, and each peer's best match.

:func:`run_matrix` runs each check once on the peer and compares the result with each variant's
oracle. A peer that raises gets an ``error`` cell naming the op, the exception and the input shapes;
its other checks, and the other peers, still run. A peer that is not available here gets one row
saying why. The best-matching variant is the one with the most passing checks (ties: the smaller
sum of log error ratios); :meth:`PeerResult.cells` reports every check against it.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from harness.conformance.checks import (
    CheckSpec,
    Comparison,
    check_specs,
    compare,
    expected_exact_sums,
    expected_orientation,
    observe_exact_sums,
    observe_orientation,
    run_side,
)
from harness.conformance.oracle import VARIANT_NAMES, oracle
from harness.peers.base import Peer
from mhc_core.testing import tolerance

__all__ = ["Cell", "Matrix", "PeerResult", "run_matrix"]


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One check of one peer against one variant."""

    check: str
    op: str
    variant: str | None
    status: str
    """``pass``, ``fail``, ``n/a`` (the peer has no such op, or a declared difference) or ``error``."""
    max_abs: float | None = None
    ratio: float | None = None
    bound: str = ""
    worst: str = ""
    """The tensor with the largest error ratio, and where."""
    observed: str | None = None
    """For orientation / exact-sums: what the peer does."""
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_abs", "ratio"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


@dataclass(frozen=True, kw_only=True)
class PeerResult:
    """A peer's row: its version, availability and cells for every variant."""

    peer: str
    description: str
    version: str | None
    skipped: str | None
    claims: str | None
    by_variant: dict[str, list[Cell]] = field(default_factory=dict)
    variant_free: list[Cell] = field(default_factory=list)

    def score(self, variant: str) -> tuple[int, float]:
        cells = self.by_variant.get(variant, [])
        passes = sum(c.status == "pass" for c in cells)
        logs = sum(math.log10(max(c.ratio, 1e-300)) for c in cells if c.ratio is not None and math.isfinite(c.ratio))
        return passes, -logs

    @property
    def best(self) -> str | None:
        """The variant this peer matches best (None when it was skipped or has no variant checks)."""
        if self.skipped or not self.by_variant:
            return None
        return max(VARIANT_NAMES, key=lambda v: (*self.score(v), v == self.claims))

    def cells(self, variant: str | None = None) -> list[Cell]:
        """Every check against ``variant`` (default: the best), then the variant-free ones."""
        v = variant or self.best
        return [*(self.by_variant.get(v, []) if v else []), *self.variant_free]

    @property
    def conforms(self) -> bool:
        """Every comparable check passes against the best variant."""
        return not self.skipped and all(c.status in ("pass", "n/a") for c in self.cells())

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.peer, "description": self.description, "version": self.version,
                "skipped": self.skipped, "claims": self.claims, "best": self.best,
                "scores": {v: {"pass": self.score(v)[0], "of": len(self.by_variant.get(v, []))}
                           for v in self.by_variant},
                "cells": [c.to_json() for c in self.cells()],
                "by_variant": {v: [c.to_json() for c in cs] for v, cs in self.by_variant.items()}}


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """Every peer's result."""

    peers: tuple[PeerResult, ...]

    def to_json(self) -> dict[str, Any]:
        return {"variants": list(VARIANT_NAMES), "peers": [p.to_json() for p in self.peers]}

    def peer(self, name: str) -> PeerResult:
        for p in self.peers:
            if p.peer == name:
                return p
        raise KeyError(f"no peer {name!r} in the matrix (has: {', '.join(p.peer for p in self.peers)})")


def _bound(dtype: torch.dtype) -> str:
    f, b = tolerance(dtype, "fwd"), tolerance(dtype, "bwd")
    return f"fwd {f.atol:g}+{f.rtol:g}|e|, bwd {b.atol:g}+{b.rtol:g}|e|"


def _worst(comparisons: Sequence[Comparison]) -> Comparison:
    return max(comparisons, key=lambda c: c.ratio)


def _numeric_cell(spec: CheckSpec, variant: str | None, comparisons: list[Comparison], note: str | None) -> Cell:
    w = _worst(comparisons)
    ok = w.ratio <= 1
    msg = "" if ok else f"{w.name}: max abs err {w.max_abs:.3e}, {w.ratio:.3g}x its bound ({w.detail})"
    if not ok and note:
        msg += f"; known difference: {note}"
    return Cell(check=spec.id, op=spec.op, variant=variant, status="pass" if ok else "fail", max_abs=w.max_abs,
                ratio=w.ratio, bound=_bound(spec.dtype), worst=f"{w.name} {w.detail}".strip(), message=msg)


def _shapes(spec: CheckSpec) -> str:
    c = spec.case
    return f"x {list(c.x.shape)}, n={spec.n}, {spec.dtype}"


def _run_peer(peer: Peer, variants: Sequence[str]) -> PeerResult:
    result = PeerResult(peer=peer.name, description=peer.description, version=peer.version(), skipped=None,
                        claims=peer.claims, by_variant={v: [] for v in variants})
    for op, why in peer.differences.items():
        if op not in peer.ops:
            for v in variants:
                result.by_variant[v].append(Cell(check=f"{op}", op=op, variant=v, status="n/a",
                                                 message=f"not comparable: {why}"))
    for spec in check_specs(peer):
        if spec.op not in peer.ops:
            continue
        note = peer.differences.get(spec.op)
        try:
            side = peer.side(spec) if hasattr(peer, "side") else run_side(peer, spec, spec.dtype)
        except Exception as exc:  # a peer that raises: named, and the rest still runs
            msg = (f"{peer.name} raised {type(exc).__name__} in {spec.op} ({_shapes(spec)}): {exc}; "
                   f"{traceback.format_exception_only(exc)[-1].strip()}")
            cells = [Cell(check=spec.id, op=spec.op, variant=v, status="error", message=msg)
                     for v in ([None] if spec.variant_free else variants)]
            (result.variant_free.extend if spec.variant_free else
             lambda cs: [result.by_variant[c.variant].append(c) for c in cs])(cells)
            continue
        if spec.variant_free:
            ref = run_side(oracle("megatron_dev"), spec, torch.float64, keys=tuple(side[0]))
            result.variant_free.append(_numeric_cell(spec, None, compare(side, ref, spec.dtype), note))
            continue
        if spec.kind == "orientation":
            seen, plain, transposed = observe_orientation(side[0]["out"], spec)
            for v in variants:
                want = expected_orientation(v)
                ok = seen == want
                result.by_variant[v].append(Cell(
                    check=spec.id, op=spec.op, variant=v, status="pass" if ok else "fail", observed=seen,
                    ratio=transposed if want == "H^T @ x" else plain, bound=_bound(spec.dtype),
                    message="" if ok else f"mixes as {seen} (error ratio {plain:.3g} to H @ x, {transposed:.3g} to "
                                          f"H^T @ x); {v} mixes as {want}"))
            continue
        if spec.kind == "exact_sums":
            seen, rows, cols = observe_exact_sums(side[0]["h_res"], spec.dtype)
            for v in variants:
                want = expected_exact_sums(v)
                ok = seen == want
                result.by_variant[v].append(Cell(
                    check=spec.id, op=spec.op, variant=v, status="pass" if ok else "fail", observed=seen,
                    max_abs=max(rows, cols), message=f"max |rowsum - 1| {rows:.2e}, |colsum - 1| {cols:.2e}"
                    + ("" if ok else f"; {v} leaves {want} exact")))
            continue
        for v in variants:
            ref = run_side(oracle(v), spec, torch.float64, keys=tuple(side[0]))
            result.by_variant[v].append(_numeric_cell(spec, v, compare(side, ref, spec.dtype), note))
    return result


def run_matrix(peers: Iterable[Peer], variants: Sequence[str] = VARIANT_NAMES) -> Matrix:
    """Run every check of every peer (see the module docstring)."""
    rows = []
    for peer in peers:
        why = peer.unavailable()
        if why:
            rows.append(PeerResult(peer=peer.name, description=peer.description, version=peer.version(),
                                   skipped=why, claims=peer.claims))
            continue
        rows.append(_run_peer(peer, variants))
    return Matrix(peers=tuple(rows))
