"""The conformance matrix: every peer x every check, against every variant, and each peer's best match.

`run_matrix` runs each check once on the peer and compares the result with each variant's
oracle. A peer that raises gets an `error` cell naming the op, the exception and the input shapes;
its other checks, and the other peers, still run. A peer that is not available here gets one row
saying why. The best-matching variant is the one with the most passing checks (ties: the smaller
sum of log error ratios).

Then every variant with each combination of its named options (`mhc_core.variants`) that the
peer's ops can show is tried: the eps placement (through `coefficients` and `layer`), the
orientation of the mix (`mix`, `orientation`, `layer`) and the block exit (`block-exit`, which
is compared only here). The best configuration is the one with the most passes (ties: fewer options,
the one claimed, then the smaller sum of log error ratios), e.g.
`megatron_dev+eps_inside_sqrt+learned_exit`; `PeerResult.cells` reports every check against
it. Each oracle runs once per part of a configuration a check can see. The mapping precision is not
among the options tried: the oracle computes in fp64, where it changes nothing.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
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
from mhc_core.variants import (
    NormEpsPlacement,
    NumericsOptions,
    OutputContraction,
    ResidualMix,
    configure,
    get_variant,
)

__all__ = ["Cell", "Matrix", "PeerResult", "run_matrix"]


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One check of one peer against one variant."""

    check: str
    op: str
    variant: str | None
    status: str
    """`pass`, `fail`, `n/a` (the peer has no such op, or a declared difference) or `error`."""
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
    """Every check but `block-exit` against each variant with its own numerics."""
    by_configuration: dict[str, list[Cell]] = field(default_factory=dict)
    """Every check against each configuration tried: the plain variants, then each with its options."""

    @staticmethod
    def _score(cells: Sequence[Cell]) -> tuple[int, float]:
        passes = sum(c.status == "pass" for c in cells)
        logs = sum(math.log10(max(c.ratio, 1e-300)) for c in cells if c.ratio is not None and math.isfinite(c.ratio))
        return passes, -logs

    def score(self, variant: str) -> tuple[int, float]:
        """(passes, minus the sum of log error ratios) against `variant` or a configuration tried."""
        return self._score(self.by_variant.get(variant) or self.by_configuration.get(variant, []))

    @property
    def best(self) -> str | None:
        """The variant this peer matches best (None when it was skipped or has no variant checks)."""
        if self.skipped or not self.by_variant:
            return None
        claimed = None if self.claims is None else get_variant(self.claims).variant.value
        return max(VARIANT_NAMES, key=lambda v: (*self.score(v), v == claimed))

    @property
    def configuration(self) -> str | None:
        """The configuration this peer matches best: its best variant with the options that fit it."""
        if not self.by_configuration:
            return self.best

        claimed = None if self.claims is None else get_variant(self.claims).name

        def key(name: str) -> tuple:
            passes, logs = self._score(self.by_configuration[name])
            return passes, -name.count("+"), name == claimed, logs

        return max(self.by_configuration, key=key)

    def cells(self, configuration: str | None = None) -> list[Cell]:
        """Every check against `configuration` (a variant or a configuration tried; default: the best one)."""
        c = configuration or self.configuration
        if c in self.by_configuration:
            return list(self.by_configuration[c])
        return list(self.by_variant.get(c, [])) if c else []

    @property
    def conforms(self) -> bool:
        """Every comparable check passes against the best configuration."""
        return not self.skipped and all(c.status in ("pass", "n/a") for c in self.cells())

    @property
    def meets_claim(self) -> bool:
        """It conforms, and to the configuration it claims (when it claims one)."""
        return self.conforms and (self.claims is None or get_variant(self.claims).name == self.configuration)

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.peer, "description": self.description, "version": self.version,
                "skipped": self.skipped, "claims": self.claims, "best": self.best,
                "configuration": self.configuration,
                "scores": {v: {"pass": self.score(v)[0], "of": len(cs)}
                           for v, cs in (*self.by_variant.items(), *self.by_configuration.items())},
                "cells": [c.to_json() for c in self.cells()],
                "by_variant": {v: [c.to_json() for c in cs] for v, cs in self.by_variant.items()},
                "by_configuration": {v: [c.to_json() for c in cs] for v, cs in self.by_configuration.items()}}


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """Every peer's result."""

    peers: tuple[PeerResult, ...]

    def to_json(self) -> dict[str, Any]:
        return {"variants": list(VARIANT_NAMES), "options": list(OPTION_OPS), "peers": [p.to_json() for p in self.peers]}

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


OPTION_OPS = {"norm_eps_placement": ("coefficients", "layer"), "residual_mix": ("mix", "layer"),
              "output_contraction": ("block_exit",)}
"""The options the checks can observe, and the ops whose checks show them."""


def _error_cells(peer: Peer, spec: CheckSpec, exc: Exception, variants: Sequence[str | None]) -> list[Cell]:
    msg = (f"{peer.name} raised {type(exc).__name__} in {spec.op} ({_shapes(spec)}): {exc}; "
           f"{traceback.format_exception_only(exc)[-1].strip()}")
    return [Cell(check=spec.id, op=spec.op, variant=v, status="error", message=msg) for v in variants]


def _na_cells(peer: Peer, variant: str, ops: Iterable[str]) -> list[Cell]:
    return [Cell(check=f"{op}", op=op, variant=variant, status="n/a", message=f"not comparable: {why}")
            for op, why in peer.differences.items() if op not in peer.ops and op in ops]


def _relevant(spec: CheckSpec, configuration: str) -> str:
    """The part of `configuration` a check can see: its oracle's name (so equal oracles run once)."""
    s = get_variant(configuration)
    if spec.op == "block_exit":  # the exit alone
        return configure("megatron_dev", NumericsOptions(output_contraction=s.output_contraction)).name
    keep = {"norm_eps_placement": s.norm_eps_placement if spec.op in OPTION_OPS["norm_eps_placement"] else None,
            "residual_mix": s.residual_mix if spec.op in OPTION_OPS["residual_mix"] else None}
    return configure(s.variant, NumericsOptions(**keep)).name


class _Cells:
    """The cells of one peer's checks against any configuration, each oracle run once."""

    def __init__(self, peer: Peer):
        self.peer, self.sides, self._cache = peer, [], {}

    def cell(self, spec: CheckSpec, side: Any, configuration: str) -> Cell:
        key = (spec.id, _relevant(spec, configuration))
        if key not in self._cache:
            self._cache[key] = self._compute(spec, side, key[1])
        return replace(self._cache[key], variant=configuration)

    def _compute(self, spec: CheckSpec, side: Any, v: str) -> Cell:
        if isinstance(side, Exception):
            return _error_cells(self.peer, spec, side, [v])[0]
        if spec.kind == "orientation":
            seen, plain, transposed = observe_orientation(side[0]["out"], spec)
            want = expected_orientation(v)
            ok = seen == want
            return Cell(check=spec.id, op=spec.op, variant=v, status="pass" if ok else "fail", observed=seen,
                        ratio=transposed if want == "H^T @ x" else plain, bound=_bound(spec.dtype),
                        message="" if ok else f"mixes as {seen} (error ratio {plain:.3g} to H @ x, {transposed:.3g} "
                                              f"to H^T @ x); {v} mixes as {want}")
        if spec.kind == "exact_sums":
            seen, rows, cols = observe_exact_sums(side[0]["h_res"], spec.dtype)
            want = expected_exact_sums(v)
            ok = seen == want
            return Cell(check=spec.id, op=spec.op, variant=v, status="pass" if ok else "fail", observed=seen,
                        max_abs=max(rows, cols), message=f"max |rowsum - 1| {rows:.2e}, |colsum - 1| {cols:.2e}"
                        + ("" if ok else f"; {v} leaves {want} exact"))
        ref = run_side(oracle(v), spec, torch.float64, keys=tuple(side[0]))
        return _numeric_cell(spec, v, compare(side, ref, spec.dtype), self.peer.differences.get(spec.op))

    def against(self, configuration: str, exit_check: bool) -> list[Cell]:
        """Every check (`block-exit` only when `exit_check`) against `configuration`, n/a cells first."""
        ops = _VARIANT_OPS + (("block_exit",) if exit_check else ())
        return [*_na_cells(self.peer, configuration, ops),
                *(self.cell(spec, side, configuration) for spec, side in self.sides
                  if exit_check or spec.op != "block_exit")]


def _configurations(peer: Peer, variants: Sequence[str]) -> list[str]:
    """Each variant with each combination of the options the peer's ops show (the plain variants first)."""
    shown = {o for o, ops in OPTION_OPS.items() if set(ops) & peer.ops}
    eps = [None, NormEpsPlacement.INSIDE_SQRT] if "norm_eps_placement" in shown else [None]
    mixes = [ResidualMix.UNTRANSPOSED, ResidualMix.TRANSPOSED] if "residual_mix" in shown else [None]
    exits = [OutputContraction.MEAN, OutputContraction.LEARNED] if "output_contraction" in shown else [None]
    names = [configure(v, NumericsOptions(norm_eps_placement=e, residual_mix=m, output_contraction=x)).name
             for v in variants for e in eps for m in mixes for x in exits]
    return list(dict.fromkeys([*variants, *names]))


def _run_peer(peer: Peer, variants: Sequence[str]) -> PeerResult:
    cells = _Cells(peer)
    for spec in check_specs(peer):
        if spec.op not in peer.ops:
            continue
        try:
            side = peer.side(spec) if hasattr(peer, "side") else run_side(peer, spec, spec.dtype)
        except Exception as exc:  # a peer that raises: named, and the rest still runs
            side = exc
        cells.sides.append((spec, side))
    return PeerResult(peer=peer.name, description=peer.description, version=peer.version(), skipped=None,
                      claims=peer.claims, by_variant={v: cells.against(v, exit_check=False) for v in variants},
                      by_configuration={c: cells.against(c, exit_check=True) for c in _configurations(peer, variants)})


_VARIANT_OPS = ("coefficients", "aggregate", "mix", "sinkhorn", "layer")


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
