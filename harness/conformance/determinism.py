"""Determinism verdicts of one op: bitwise run to run, batch invariance, thread-count invariance.

A `Subject` is an op under a name (`pre[compiled]`, `pre_forward[native:avx2]`), its inputs and what to
differentiate. `probe` calls it, forward and backward under fixed cotangents, and measures three things as the
largest absolute difference over every output and gradient (0.0: bitwise):

- *run to run*: the same call twice;
- *batch invariance*: the first `split` tokens computed inside the whole batch against the same tokens alone
  (outputs and the per-token gradients; a gradient summed over tokens, a weight's, is not per token);
- *thread-count invariance*: under `torch.set_num_threads(1)` against `2` (and the subject's own `threads=`
  argument where it takes one).

`Verdict.cell()` is the column a table prints: `bitwise`, or each difference that is not zero.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Subject", "Verdict", "probe", "verdict_table"]


@dataclass(frozen=True, kw_only=True)
class Subject:
    """An op to probe: `fn(**inputs, **kwargs)` returns a tensor or a tuple of them, each with tokens on dim 0."""

    name: str
    fn: Callable[..., Any]
    inputs: dict[str, torch.Tensor]
    grad_names: tuple[str, ...] = ()
    """Inputs whose gradients are compared (none: a forward-only op)."""
    token_inputs: tuple[str, ...] = ("x",)
    """Inputs whose dim 0 is tokens: sliced for the batch probe; their gradients are per token."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    threads_kwarg: str | None = None
    """The name of a `threads=` argument the op takes (native kernels), set with the thread count."""
    per_token_outputs: tuple[int, ...] | None = None
    """Which outputs have tokens on dim 0 (None: all); the others (a weight's gradient) sit out the batch probe."""

    def __post_init__(self) -> None:
        missing = [k for k in (*self.grad_names, *self.token_inputs) if k not in self.inputs]
        if missing:
            raise ValueError(f"Subject {self.name}: {missing} are not inputs ({', '.join(self.inputs)})")


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The largest absolute difference of each probe (0.0: bitwise; None: not probed)."""

    subject: str
    run_to_run: float
    batch: float | None
    threads: float | None

    @property
    def bitwise(self) -> bool:
        return all(v in (0.0, None) for v in (self.run_to_run, self.batch, self.threads))

    def cell(self) -> str:
        """`bitwise`, or `run 0 · batch 5.96e-08 · threads 0` (`n/a` for a probe not taken)."""
        if self.bitwise:
            return "bitwise"
        parts = {"run": self.run_to_run, "batch": self.batch, "threads": self.threads}
        return " · ".join(
            f"{k} {'n/a' if v is None else ('0' if v == 0 else f'{v:.3g}')}" for k, v in parts.items()
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "run_to_run": self.run_to_run,
            "batch": self.batch,
            "threads": self.threads,
        }


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _cotangents(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(20261207)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device) for o in outs]


def _run(
    subject: Subject,
    inputs: dict[str, torch.Tensor],
    cotangents: list[torch.Tensor] | None,
    threads: int | None,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], list[torch.Tensor]]:
    """(outputs, gradients of `grad_names`, the cotangents used) of one call."""
    leaves = {k: v.detach().clone().requires_grad_(k in subject.grad_names) for k, v in inputs.items()}
    kwargs = dict(subject.kwargs)
    if subject.threads_kwarg is not None and threads is not None:
        kwargs[subject.threads_kwarg] = threads
    outs = _as_tuple(subject.fn(**leaves, **kwargs))
    cots = _cotangents(outs) if cotangents is None else cotangents
    if len(cots) != len(outs):  # the batch probe passes the per-token outputs' only
        cots = [c for c in cots if c is not None]
    grads: dict[str, torch.Tensor] = {}
    if subject.grad_names:
        loss = sum((o.float() * c).sum() for o, c in zip(outs, cots, strict=True) if o.requires_grad)
        wanted = [leaves[k] for k in subject.grad_names]
        got = (
            torch.autograd.grad(loss, wanted, allow_unused=True)
            if torch.is_tensor(loss)
            else [None] * len(wanted)
        )
        grads = {k: g for k, g in zip(subject.grad_names, got, strict=True) if g is not None}
    return tuple(o.detach() for o in outs), grads, cots


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference (NaN where both are NaN counts as equal; a shape mismatch is inf)."""
    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.double(), b.double()
    both_nan = a64.isnan() & b64.isnan()
    d = (a64 - b64).abs().masked_fill(both_nan, 0.0)
    return float(d.max()) if d.numel() else 0.0


def _differ(
    left: tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]],
    right: tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]],
    grad_names: Sequence[str] | None = None,
) -> float:
    outs = [_max_diff(a, b) for a, b in zip(left[0], right[0], strict=True)]
    names = left[1].keys() if grad_names is None else grad_names
    grads = [_max_diff(left[1][k], right[1][k]) for k in names if k in left[1] and k in right[1]]
    return max(outs + grads, default=0.0)


def probe(subject: Subject, *, split: int | None = None, thread_counts: tuple[int, int] = (1, 2)) -> Verdict:
    """The three probes of `subject` (module docstring); `split`: tokens of the batch probe (default half of the
    first token input's rows; None when it has one row). The caller's thread count is restored."""
    before = torch.get_num_threads()
    try:
        first, grads, cots = _run(subject, subject.inputs, None, None)
        again, grads_again, _ = _run(subject, subject.inputs, cots, None)
        run_to_run = _differ((first, grads), (again, grads_again))

        rows = subject.inputs[subject.token_inputs[0]].shape[0]
        k = split if split is not None else rows // 2
        batch = None
        if 0 < k < rows:
            alone_inputs = {
                name: (t[:k] if name in subject.token_inputs else t) for name, t in subject.inputs.items()
            }
            alone, alone_grads, _ = _run(subject, alone_inputs, [c[:k] for c in cots], None)
            if subject.per_token_outputs is not None and subject.grad_names:
                raise ValueError(f"Subject {subject.name}: per_token_outputs is for forward-only ops")
            keep = range(len(first)) if subject.per_token_outputs is None else subject.per_token_outputs
            head = tuple(first[i][:k] for i in keep)
            head_grads = {name: g[:k] for name, g in grads.items() if name in subject.token_inputs}
            batch = _differ(
                (head, head_grads), (tuple(alone[i] for i in keep), alone_grads), list(head_grads)
            )

        results = []
        for n in thread_counts:
            torch.set_num_threads(n)
            out, g, _ = _run(subject, subject.inputs, cots, n)
            results.append((out, g))
        threads = _differ(results[0], results[1])
    finally:
        torch.set_num_threads(before)
    return Verdict(subject=subject.name, run_to_run=run_to_run, batch=batch, threads=threads)


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    """A markdown table: subject | run to run | batch | threads | verdict."""

    def num(v: float | None) -> str:
        return "n/a" if v is None else ("0" if v == 0 else f"{v:.3g}")

    lines = [
        "| subject | run to run | batch invariance | 1 vs 2 threads | verdict |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        lines.append(
            f"| {v.subject} | {num(v.run_to_run)} | {num(v.batch)} | {num(v.threads)} | "
            f"{'bitwise' if v.bitwise else 'varies'} |"
        )
    return "\n".join(lines)


PEER_OPS = ("coefficients", "aggregate", "mix", "sinkhorn", "layer")
"""The ops whose first numeric check (largest n, the peer's first dtype) a peer's determinism verdict probes."""

TOKEN_FIELDS = ("x", "h_pre", "h_post", "h_res", "y", "logits", "h0")
"""The fields of a conformance `Case` with tokens on dim 0."""


def _side_diff(a: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], b: Any) -> float:
    """`_differ` of two `run_side` results (outputs by name, gradients by name) over the outputs both have."""
    keys = [k for k in a[0] if k in b[0]]
    return _differ((tuple(a[0][k] for k in keys), a[1]), (tuple(b[0][k] for k in keys), b[1]))


def peer_determinism(peer: Any, sides: Sequence[tuple[Any, Any]]) -> Verdict | None:
    """A peer's verdict over its probe checks (`PEER_OPS`), each difference the largest over them: the checks'
    first run (`sides`: `(spec, (outputs, gradients) or the exception)` from the matrix) against a second run,
    the forward of the first `TOKENS // 2` tokens alone (its gradients would need the whole batch's cotangents),
    and one thread against the session's count (two where the session runs one). None when no probe check ran (a replayed peer: its recording is one run)."""
    from harness.conformance.checks import run_side

    ok = [(spec, side) for spec, side in sides if isinstance(side, tuple) and spec.kind == "numeric"]
    if not ok:
        return None
    n = max(spec.n for spec, _ in ok)
    dtype = ok[0][0].dtype
    chosen: dict[str, tuple[Any, Any]] = {}
    for spec, side in ok:
        if spec.op in PEER_OPS and spec.n == n and spec.dtype == dtype and spec.op not in chosen:
            chosen[spec.op] = (spec, side)
    if not chosen:
        return None
    before = torch.get_num_threads()
    run_to_run = batch = threads = 0.0
    try:
        for spec, first in chosen.values():
            again = run_side(peer, spec, spec.dtype)  # on the session's thread count, as the first run
            run_to_run = max(run_to_run, _side_diff(first, again))
            rows = spec.case.x.shape[0]
            k = rows // 2
            alone_case = dataclasses.replace(
                spec.case, **{f: getattr(spec.case, f)[:k] for f in TOKEN_FIELDS}
            )
            alone = run_side(peer, dataclasses.replace(spec, case=alone_case), spec.dtype)[0]
            head = {name: t[:k] for name, t in first[0].items() if t.dim() and t.shape[0] == rows}
            batch = max(batch, _side_diff((head, {}), (alone, {})))
            torch.set_num_threads(1 if before > 1 else 2)
            threads = max(threads, _side_diff(run_side(peer, spec, spec.dtype), again))
            torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)
    return Verdict(
        subject=f"{peer.name} ({', '.join(chosen)}; n{n})",
        run_to_run=run_to_run,
        batch=batch,
        threads=threads,
    )
