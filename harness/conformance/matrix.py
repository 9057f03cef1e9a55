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
the one claimed, then the smaller sum of log error ratios; a half-precision check failing within
`HALF_UNDECIDED` times its allowance counts as neither in that ranking), e.g.
`megatron_dev+eps_inside_sqrt+learned_exit`; `PeerResult.cells` reports every check against
it. Each oracle runs once per part of a configuration a check can see.

Half precision (bf16 / fp16 checks): the bound scales with the reference's own rounding. The configuration's
reference runs the check in the same dtype too, and a tensor of the peer passes when its error against fp64 is
within `HALF_FACTOR` times the reference's own error ratio (or within the bound). So the bound follows what the
configuration computes in that dtype, and the mapping precision (`fp32_mappings` / `activation_mappings`), which
changes nothing in fp64, is among the options tried for those checks: a peer whose projection and gates run in
bf16 matches `activation_mappings`.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from harness.conformance.checks import (
    EXIT_OPS,
    GRAD_SIZE_FACTOR,
    CheckSpec,
    Comparison,
    check_specs,
    compare,
    expected_exact_sums,
    expected_orientation,
    grad_sizes,
    observe_exact_sums,
    observe_orientation,
    run_side,
    single_pass_stack_source,
    stack_source,
)
from harness.conformance.determinism import Verdict, peer_determinism
from harness.conformance.oracle import VARIANT_NAMES, oracle_for
from harness.peers.base import Peer, Replayed
from mhc_core.testing import tolerance
from mhc_core.variants import (
    MappingPrecision,
    NormEpsPlacement,
    NumericsOptions,
    OutputContraction,
    ResidualMix,
    SinkhornPrecision,
    configure,
    get_variant,
)

__all__ = ["HALF_FACTOR", "Cell", "Matrix", "PeerResult", "run_matrix"]

HALF_FACTOR = 4.0
"""A half-precision check passes a tensor whose error is within this many times the reference's own error in that
dtype (both as ratios to the dtype's bound, against fp64)."""
_HALF = (torch.bfloat16, torch.float16)
HALF_UNDECIDED = 1.5
"""A half-precision check that fails within this many times its allowance decides nothing between two
configurations: in ranking them it counts as neither pass nor fail (the reported counts are unchanged), so a label
is named only on evidence beyond the half-precision bound's noise."""
_HALF_TAGS = (" bf16", " fp16")


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

    @property
    def severity(self) -> float:
        """How far off it is, for ordering: the error over the bound; for a gradient norm (`stack-grads`) the factor
        either way; 0 without a number (`observed`, `error`)."""
        if self.ratio is None or math.isnan(self.ratio):
            return 0.0
        if self.max_abs is None:  # a gradient norm ratio, peer / reference
            return math.inf if self.ratio == 0 else max(self.ratio, 1 / self.ratio)
        return self.ratio

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_abs", "ratio"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


def _undecided(cells: Sequence[Cell]) -> int:
    """The half-precision checks whose error fails within `HALF_UNDECIDED` times their allowance (noise, not
    evidence; a `stack-grads` norm ratio is no error ratio and always counts)."""
    return sum(
        c.status == "fail"
        and c.check.endswith(_HALF_TAGS)
        and c.max_abs is not None
        and c.ratio is not None
        and c.ratio <= HALF_UNDECIDED
        for c in cells
    )


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
    determinism: Verdict | None = None
    """Run to run, batch and thread-count invariance of its probe checks (`harness.conformance.determinism`)."""
    determinism_note: str | None = None
    """Why there is no verdict: what the peer raised when a probe ran it again (`error: ...`), or `n/a: ...`."""

    @staticmethod
    def _score(cells: Sequence[Cell]) -> tuple[int, float]:
        passes = sum(c.status == "pass" for c in cells)
        logs = sum(
            math.log10(max(c.ratio, 1e-300)) for c in cells if c.ratio is not None and math.isfinite(c.ratio)
        )
        return passes, -logs

    def score(self, variant: str) -> tuple[int, float]:
        """(passes, minus the sum of log error ratios) against the plain `variant` (`by_variant`)."""
        return self._score(self.by_variant.get(variant, []))

    @staticmethod
    def _count(cells: Sequence[Cell]) -> tuple[int, int]:
        return sum(c.status == "pass" for c in cells), len(cells)

    def tally(self, variant: str) -> tuple[int, int]:
        """`(passes, checks)` against the plain `variant` (`by_variant`: without the exit-dependent checks): the
        per-variant count every output prints."""
        return self._count(self.by_variant.get(variant, []))

    def configuration_tally(self, name: str) -> tuple[int, int]:
        """`(passes, checks)` against the configuration `name` (all its checks, the exit-dependent ones too)."""
        return self._count(self.by_configuration.get(name, []))

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
            cells = self.by_configuration[name]
            passes, logs = self._score(cells)
            return passes + _undecided(cells), -name.count("+"), name == claimed, logs

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

    def claim_misses(self) -> list[Cell]:
        """The checks that fail (or raise) against the configuration it claims: `orientation` first (a mix applied
        transposed fails most of the rest with it), then the farthest off first (`Cell.severity`); empty without a
        claim."""
        if self.claims is None:
            return []
        misses = [c for c in self.cells(get_variant(self.claims).name) if c.status in ("fail", "error")]

        return sorted(misses, key=lambda c: (not c.check.startswith("orientation "), -c.severity))

    def to_json(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "description": self.description,
            "version": self.version,
            "skipped": self.skipped,
            "claims": self.claims,
            "determinism": None if self.determinism is None else self.determinism.to_json(),
            "determinism_note": self.determinism_note,
            "best": self.best,
            "configuration": self.configuration,
            "scores": {v: dict(zip(("pass", "of"), self.tally(v), strict=True)) for v in self.by_variant},
            "configuration_scores": {
                c: dict(zip(("pass", "of"), self.configuration_tally(c), strict=True))
                for c in self.by_configuration
            },
            "claim": None
            if self.claims is None
            else {
                "claims": self.claims,
                "met": self.meets_claim,
                "misses": [c.to_json() for c in self.claim_misses()],
            },
            "cells": [c.to_json() for c in self.cells()],
            "by_variant": {v: [c.to_json() for c in cs] for v, cs in self.by_variant.items()},
            "by_configuration": {v: [c.to_json() for c in cs] for v, cs in self.by_configuration.items()},
        }


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """Every peer's result."""

    peers: tuple[PeerResult, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "variants": list(VARIANT_NAMES),
            "options": list(OPTION_OPS),
            "peers": [p.to_json() for p in self.peers],
        }

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


def _numeric_cell(
    spec: CheckSpec, variant: str | None, comparisons: list[Comparison], note: str | None
) -> Cell:
    w = _worst(comparisons)
    ok = w.ratio <= 1
    msg = "" if ok else f"{w.name}: max abs err {w.max_abs:.3e}, {w.ratio:.3g}x its bound ({w.detail})"
    if not ok and note:
        msg += f"; known difference: {note}"
    return Cell(
        check=spec.id,
        op=spec.op,
        variant=variant,
        status="pass" if ok else "fail",
        max_abs=w.max_abs,
        ratio=w.ratio,
        bound=_bound(spec.dtype),
        worst=f"{w.name} {w.detail}".strip(),
        message=msg,
    )


def _shapes(spec: CheckSpec) -> str:
    c = spec.case
    return f"x {list(c.x.shape)}, n={spec.n}, {spec.dtype}"


OPTION_OPS = {
    "norm_eps_placement": ("coefficients", "layer", "stack", "single_pass", "single_pass_stack"),
    "residual_mix": ("mix", "layer", "stack", "single_pass_stack"),
    "output_contraction": ("block_exit", "stack"),
    "mapping_precision": ("coefficients", "layer", "stack", "single_pass", "single_pass_stack"),
    "sinkhorn_precision": ("sinkhorn", "coefficients", "layer", "stack", "single_pass", "single_pass_stack"),
}
"""The options the checks can observe, and the ops whose checks show them (the mapping precision and the dtype
Sinkhorn iterates in: in half precision only)."""


def _error_cells(peer: Peer, spec: CheckSpec, exc: Exception, variants: Sequence[str | None]) -> list[Cell]:
    msg = (
        f"{peer.name} raised {type(exc).__name__} in {spec.op} ({_shapes(spec)}): {exc}; "
        f"{traceback.format_exception_only(exc)[-1].strip()}"
    )
    return [Cell(check=spec.id, op=spec.op, variant=v, status="error", message=msg) for v in variants]


def _na_cells(peer: Peer, variant: str, ops: Iterable[str]) -> list[Cell]:
    return [
        Cell(check=f"{op}", op=op, variant=variant, status="n/a", message=f"not comparable: {why}")
        for op, why in peer.differences.items()
        if op not in peer.ops and op in ops
    ]


def _relevant(spec: CheckSpec, configuration: str) -> str:
    """The part of `configuration` a check can see: its oracle's name (so equal oracles run once)."""
    s = get_variant(configuration)
    if spec.op == "block_exit":  # the exit alone
        return configure("megatron_dev", NumericsOptions(output_contraction=s.output_contraction)).name
    keep = {
        "norm_eps_placement": s.norm_eps_placement if spec.op in OPTION_OPS["norm_eps_placement"] else None,
        "residual_mix": s.residual_mix if spec.op in OPTION_OPS["residual_mix"] else None,
        "output_contraction": s.output_contraction if spec.op in OPTION_OPS["output_contraction"] else None,
        "mapping_precision": s.mapping_precision
        if spec.op in OPTION_OPS["mapping_precision"] and spec.dtype in _HALF
        else None,
        "sinkhorn_precision": s.sinkhorn_precision
        if spec.op in OPTION_OPS["sinkhorn_precision"] and spec.dtype in _HALF
        else None,
    }
    return configure(s.variant, NumericsOptions(**keep)).name


class _Cells:
    """The cells of one peer's checks against any configuration, each oracle run once."""

    def __init__(self, peer: Peer):
        self.peer = peer
        self.sides: list[tuple[CheckSpec, Any]] = []
        """Each check's side: the peer's outputs and gradients, or the exception it raised."""
        self._cache: dict[tuple[str, str], Cell] = {}
        self._refs: dict[Any, Any] = {}
        self._own: dict[Any, Any] = {}

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
            return Cell(
                check=spec.id,
                op=spec.op,
                variant=v,
                status="pass" if ok else "fail",
                observed=seen,
                ratio=transposed if want == "H^T @ x" else plain,
                bound=_bound(spec.dtype),
                message=""
                if ok
                else f"mixes as {seen} (error ratio {plain:.3g} to H @ x, {transposed:.3g} "
                f"to H^T @ x); {v} mixes as {want}",
            )
        if spec.kind == "exact_sums":
            seen, rows, cols = observe_exact_sums(side[0]["h_res"], spec.dtype)
            want = expected_exact_sums(v, spec.dtype)
            ok = seen == want
            return Cell(
                check=spec.id,
                op=spec.op,
                variant=v,
                status="pass" if ok else "fail",
                observed=seen,
                max_abs=max(rows, cols),
                message=f"max |rowsum - 1| {rows:.2e}, |colsum - 1| {cols:.2e}"
                + ("" if ok else f"; {v} leaves {want} exact"),
            )
        ref = self._reference(spec, side, v)
        if spec.kind == "grad_sizes":
            own = None
            if spec.dtype in _HALF:
                own_side = run_side(oracle_for(v, spec.dtype), spec, spec.dtype)
                own = {g.name: g.ratio for g in grad_sizes(own_side[1], ref[1], spec.n)}
            return _grad_size_cell(spec, v, grad_sizes(side[1], ref[1], spec.n), own)
        comparisons = compare(side, ref, spec.dtype)
        if spec.dtype in _HALF:
            comparisons = _scaled(comparisons, self._own_rounding(spec, v, side, ref))
        cell = _numeric_cell(spec, v, comparisons, self.peer.differences.get(spec.op))
        if (spec.op == "stack" and stack_source(self.peer) == "chained") or (
            spec.op == "single_pass_stack" and single_pass_stack_source(self.peer) == "chained"
        ):
            cell = replace(cell, message=(cell.message + "; " if cell.message else "") + _CHAINED)
        return cell

    def _reference(self, spec: CheckSpec, side: Any, v: str) -> tuple[dict, dict]:
        """The oracle's side of a check, run once per check and fp64 oracle: `stack` and `stack-grads` share their
        inputs, and the fp64 oracle iterates Sinkhorn in fp64 whatever `sinkhorn_precision` says (the option shows
        only in the half-precision runs: `_own_rounding`, `exact-sums`)."""
        oracle_v = configure(v, NumericsOptions(sinkhorn_precision=SinkhornPrecision.FP32)).name
        shared = spec.op in ("stack", "single_pass_stack")
        key = (spec.op, spec.n, spec.dtype, oracle_v) if shared else (spec.id, oracle_v)
        if key in self._refs:
            return self._refs[key]
        ref = run_side(oracle_for(oracle_v, spec.dtype), spec, torch.float64, keys=tuple(side[0]))
        self._refs[key] = ref
        return ref

    def _own_rounding(self, spec: CheckSpec, v: str, side: Any, ref: tuple[dict, dict]) -> dict[str, float]:
        """`{tensor: error ratio}` of configuration `v`'s reference run in the check's (half-precision) dtype,
        against the fp64 oracle `ref`."""
        key = (spec.id, v)
        if key not in self._own:
            keys = tuple(side[0])
            own = run_side(oracle_for(v, spec.dtype), spec, spec.dtype, keys=keys)
            if not self.peer.differentiable:
                own = (own[0], {})
            self._own[key] = {c.name: c.ratio for c in compare(own, ref, spec.dtype)}
        return self._own[key]

    def against(self, configuration: str, exit_check: bool) -> list[Cell]:
        """Every check (those of `EXIT_OPS` only when `exit_check`) against `configuration`, n/a cells first."""
        ops = _VARIANT_OPS + (EXIT_OPS if exit_check else ())
        return [
            *_na_cells(self.peer, configuration, ops),
            *self.absent(configuration, ops),
            *(
                self.cell(spec, side, configuration)
                for spec, side in self.sides
                if exit_check or spec.op not in EXIT_OPS
            ),
        ]

    def absent(self, configuration: str, ops: Sequence[str]) -> list[Cell]:
        """n/a cells for the stack checks a peer cannot run (no stack or layer of its own, a recording made
        before them, no backward), each with its reason; nothing when the peer names the stack a difference."""
        if "stack" not in ops or "stack" in self.peer.differences:
            return []
        ran = {spec.id.split(" ")[0] for spec, _ in self.sides if spec.op == "stack"}
        why = {}
        if stack_source(self.peer) is None and "single_pass" in self.peer.ops:
            why["stack"] = why["stack-grads"] = (
                "a single-pass peer: its structure is the single-pass-stack checks"
            )
        elif stack_source(self.peer) is None:
            why["stack"] = why["stack-grads"] = (
                "not recorded: the recording predates the stack checks; re-record it"
                if hasattr(self.peer, "side")
                else "the peer has neither a stack nor a layer op to compose"
            )
        elif not self.peer.differentiable:
            why["stack-grads"] = "no backward: forward-only peer"
        return [
            Cell(check=check, op="stack", variant=configuration, status="n/a", message=f"not comparable: {r}")
            for check, r in why.items()
            if check not in ran
        ]


def _scaled(comparisons: list[Comparison], own: dict[str, float]) -> list[Comparison]:
    """Half precision: each ratio over `HALF_FACTOR` times the reference's own (at least the bound itself)."""
    out = []
    for c in comparisons:
        mine = own.get(c.name, 0.0)
        scale = max(1.0, HALF_FACTOR * mine)
        out.append(
            replace(
                c,
                ratio=c.ratio / scale,
                detail=f"{c.detail}; the reference's own error in this dtype "
                f"{mine:.3g}x the bound, allowed {HALF_FACTOR:g}x that",
            )
        )
    return out


def _configurations(peer: Peer, variants: Sequence[str]) -> list[str]:
    """Each variant with each combination of the options the peer's ops show (the plain variants first)."""
    shown = {o for o, ops in OPTION_OPS.items() if set(ops) & peer.ops}
    if not set(peer.dtypes) & set(_HALF):
        shown.discard("mapping_precision")
        shown.discard("sinkhorn_precision")
    eps = (
        [None, NormEpsPlacement.INSIDE_SQRT, NormEpsPlacement.INSIDE_SQRT_DTYPE_EPS]
        if "norm_eps_placement" in shown
        else [None]
    )
    mixes = [ResidualMix.UNTRANSPOSED, ResidualMix.TRANSPOSED] if "residual_mix" in shown else [None]
    exits = [OutputContraction.MEAN, OutputContraction.LEARNED] if "output_contraction" in shown else [None]
    precisions = (
        [MappingPrecision.FP32, MappingPrecision.ACTIVATION] if "mapping_precision" in shown else [None]
    )
    sinkhorns = [SinkhornPrecision.FP32, SinkhornPrecision.INPUT] if "sinkhorn_precision" in shown else [None]
    names = [
        configure(
            v,
            NumericsOptions(
                norm_eps_placement=e,
                residual_mix=m,
                output_contraction=x,
                mapping_precision=p,
                sinkhorn_precision=k,
            ),
        ).name
        for v in variants
        for e in eps
        for m in mixes
        for x in exits
        for p in precisions
        for k in sinkhorns
    ]
    return list(dict.fromkeys([*variants, *names]))


_CHAINED = "its layers chained by the suite (the peer has no stack of its own)"


def _grad_size_cell(spec: CheckSpec, variant: str, sizes: list, own: dict[str, float] | None = None) -> Cell:
    """`stack-grads`: pass when every part's gradient norm is within `GRAD_SIZE_FACTOR` of the reference's; in half
    precision (`own`: the reference's own norm ratios in that dtype, where a cancelled, tiny gradient is mostly
    rounding) within that factor times the reference's own deviation."""
    if not sizes:
        return Cell(
            check=spec.id, op=spec.op, variant=variant, status="n/a", message="no gradient to compare"
        )

    def off(g) -> float:
        return abs(math.log10(g.ratio)) if 0 < g.ratio < math.inf else math.inf

    def allowed(g) -> float:
        mine = (own or {}).get(g.name, 1.0)
        return math.log10(GRAD_SIZE_FACTOR) + (abs(math.log10(mine)) if 0 < mine < math.inf else 0.0)

    worst = max(sizes, key=off)
    bad = [g for g in sizes if off(g) > allowed(g)]
    text = ", ".join(
        f"{g.name} {g.peer:.2e} vs {g.reference:.2e}" for g in sorted(bad, key=off, reverse=True)
    )
    msg = (
        ""
        if not bad
        else (
            f"{len(bad)} of {len(sizes)} parameter parts get a gradient more than "
            f"{GRAD_SIZE_FACTOR:g}x off the reference's (peer vs reference norm): {text}"
        )
    )
    return Cell(
        check=spec.id,
        op=spec.op,
        variant=variant,
        status="fail" if bad else "pass",
        ratio=worst.ratio,
        bound=f"norm within {GRAD_SIZE_FACTOR:g}x",
        worst=f"{worst.name} {worst.peer:.3e} vs {worst.reference:.3e}",
        message=msg,
    )


def _runs(peer: Peer, spec: CheckSpec) -> bool:
    """Whether `peer` runs `spec` (the stack checks: with a stack or a layer it has; the gradient sizes need
    a backward)."""
    if spec.op == "single_pass_stack":
        return single_pass_stack_source(peer) is not None and (
            spec.kind != "grad_sizes" or peer.differentiable
        )
    if spec.op != "stack":
        return spec.op in peer.ops
    if "stack" in peer.differences or stack_source(peer) is None:
        return False
    return spec.kind != "grad_sizes" or peer.differentiable


def _run_peer(peer: Peer, variants: Sequence[str]) -> PeerResult:
    cells = _Cells(peer)
    for spec in check_specs(peer):
        if not _runs(peer, spec):
            continue
        side: Any
        try:
            side = peer.side(spec) if isinstance(peer, Replayed) else run_side(peer, spec, spec.dtype)
        except Exception as exc:  # a peer that raises: named, and the rest still runs
            side = exc
        cells.sides.append((spec, side))
    determinism, determinism_note = None, None
    version = peer.version() or ""
    if isinstance(peer, Replayed):
        determinism_note = "n/a: a replayed recording is one run"
    elif version.endswith("(interpreted)"):  # the interpreter's reduction order is not the GPU kernel's
        determinism_note = "n/a: Triton's interpreter (numpy) says nothing of the GPU kernel's determinism"
    else:
        try:
            determinism = peer_determinism(peer, cells.sides)
        except Exception as exc:  # a peer that raises on a repeat, with fewer tokens or on one thread
            determinism_note = f"error: {type(exc).__name__}: {exc}"
    return PeerResult(
        peer=peer.name,
        description=peer.description,
        version=peer.version(),
        skipped=None,
        claims=peer.claims,
        by_variant={v: cells.against(v, exit_check=False) for v in variants},
        by_configuration={c: cells.against(c, exit_check=True) for c in _configurations(peer, variants)},
        determinism=determinism,
        determinism_note=determinism_note,
    )


_VARIANT_OPS = ("coefficients", "aggregate", "mix", "sinkhorn", "layer", "single_pass", "single_pass_stack")


def run_matrix(peers: Iterable[Peer], variants: Sequence[str] = VARIANT_NAMES) -> Matrix:
    """Run every check of every peer (see the module docstring)."""
    rows = []
    for peer in peers:
        why = peer.unavailable()
        if why:
            rows.append(
                PeerResult(
                    peer=peer.name,
                    description=peer.description,
                    version=peer.version(),
                    skipped=why,
                    claims=peer.claims,
                )
            )
            continue
        rows.append(_run_peer(peer, variants))
    return Matrix(peers=tuple(rows))
