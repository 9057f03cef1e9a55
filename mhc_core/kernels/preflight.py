"""What the mHC kernel dispatch will run on this machine, and why: a preflight, no kernel runs.

    python -m mhc_core.kernels                                  # tensors on cuda if present, else cpu
    python -m mhc_core.kernels --n 4 --dtype bf16 --dropout 0.1  # the run's streams, activations, dropout
    python -m mhc_core.kernels --gpu-name "NVIDIA H100 80GB HBM3"  # the cuTile tuning that GPU gets
    python -m mhc_core.kernels --json

Per op: the backend that `auto` or an `MHC_BACKEND*` variable picks for tensors on the device and
why, and the backend a call runs on when cuTile does not cover it at this n, dtype or dropout (under
`auto` such a call goes to the next backend, logged once). Then every backend's availability and
the cuTile tuning in force (`mhc_core.kernels.cutile.tuning`). A training run launched with the same
environment gets the same choices, so a job script can run this first: the exit code is 1 when the
first mHC call would raise (a forced backend that is unavailable, or does not cover the call; an
invalid `MHC_BACKEND*` value; a malformed `MHC_CUTILE_TUNING` file) or when an `MHC_BACKEND_*`
variable is one the dispatch does not read (a misspelling it would silently ignore), and 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from dataclasses import asdict, dataclass

import torch

from mhc_core.kernels import dispatch
from mhc_core.variants import Variant, get_variant

__all__ = ["OpPlan", "Preflight", "cutile_gap", "preflight", "format_text", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class OpPlan:
    """Where one op runs: `backend` (chosen by `set_by`, a variable, or None for `auto`) for the calls
    cuTile covers, `runs_on` for this run's calls ("-" when its first call raises, `why` says why)."""

    op: str
    set_by: str | None
    backend: str
    runs_on: str
    why: str

    @property
    def ok(self) -> bool:
        return self.runs_on != "-"


@dataclass(frozen=True, kw_only=True)
class Preflight:
    """The whole report; `ok` is False when the first mHC call of such a run would raise."""

    device: str
    gpu_name: str | None
    torch: str
    n: int
    dtype: str
    dropout: float
    variant: str
    ops: tuple[OpPlan, ...]
    backends: dict[str, dict[str, object]]
    environment: dict[str, str]
    cutile_tuning: str | None
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def cutile_gap(op: str, *, n: int, dtype: torch.dtype, dropout: float = 0.0) -> str | None:
    """Why cuTile has no kernel for `op`'s training calls at `n` streams, `dtype` activations and
    hidden `dropout` (the kernels' own coverage checks), or None when it covers them."""
    from mhc_core.kernels.cutile import runtime

    try:
        if op == "h_post_bda":
            runtime.require_no_training_dropout(op, dropout, training=True)
        runtime.require_n(n, op)
        runtime.require_dtypes(op, activations=torch.empty(0, dtype=dtype, device="meta"))
    except NotImplementedError as exc:
        return str(exc)
    return None


def _plan(op: str, device: str, *, n: int, dtype: torch.dtype, dropout: float) -> OpPlan:
    try:
        _, set_by = dispatch.requested(op)
    except ValueError as exc:
        return OpPlan(op=op, set_by=None, backend="-", runs_on="-", why=str(exc))
    try:
        backend, reason = dispatch.resolve(op, device)
    except dispatch.BackendUnavailableError as exc:
        return OpPlan(op=op, set_by=set_by, backend="-", runs_on="-", why=str(exc))
    gap = cutile_gap(op, n=n, dtype=dtype, dropout=dropout) if backend == "cutile" else None
    if gap is None:
        return OpPlan(op=op, set_by=set_by, backend=backend, runs_on=backend, why=reason)
    if set_by is not None:  # a forced cutile propagates its NotImplementedError
        return OpPlan(
            op=op, set_by=set_by, backend=backend, runs_on="-", why=f"{set_by} forces cutile, but {gap}"
        )
    runs_on, why = dispatch.without_cutile(device, f"it does not cover this run: {gap}")
    return OpPlan(op=op, set_by=None, backend=backend, runs_on=runs_on, why=why)


def _tuning(device: str, gpu_name: str | None) -> tuple[str | None, str | None]:
    """(description of the cuTile tuning in force, or None off CUDA without a tuning; problem)."""
    from mhc_core.kernels.cutile import tuning

    if device != "cuda" and gpu_name is None and not os.environ.get(tuning.ENV):
        return None, None
    try:
        return tuning.describe(tuning.resolve(gpu_name)), None
    except ValueError as exc:
        return None, str(exc)


def preflight(
    *,
    device: str | None = None,
    gpu_name: str | None = None,
    n: int = 4,
    dtype: str = "bf16",
    dropout: float = 0.0,
    variant: str = "megatron_main",
) -> Preflight:
    """The dispatch's choices for tensors on `device` (None: cuda if present, else cpu), for a run
    with `n` streams, `dtype` activations, hidden `dropout` and the numeric `variant` (it sets the
    Sinkhorn logits' dtype); `gpu_name` (default: the GPU's name, if any) picks the shipped cuTile
    tuning."""
    spec = get_variant(variant)  # ValueError naming a bad one
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    if n < 1:
        raise ValueError(f"n={n} residual streams: must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout}: must be in [0, 1)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if gpu_name is None and device == "cuda" and torch.cuda.is_available():
        gpu_name = torch.cuda.get_device_name()
    # `paper` hands fp32 coefficients, so fp32 Sinkhorn logits, whatever the activations.
    dtypes = {op: _DTYPES[dtype] for op in dispatch.OPS}
    if not spec.coefficients_in_activation_dtype:
        dtypes["sinkhorn"] = torch.float32
    plans = tuple(_plan(op, device, n=n, dtype=dtypes[op], dropout=dropout) for op in dispatch.OPS)
    backends = {}
    for b in dispatch.BACKENDS:
        ok, why = dispatch.availability(b, device)
        backends[b] = {"available": ok, "reason": why}
    described, tuning_problem = _tuning(device, gpu_name)
    problems = [f"{p.op}: {p.why}" for p in plans if not p.ok]
    if tuning_problem:
        problems.append(tuning_problem)
    notes: list[str] = []
    env = {
        k: v for k, v in sorted(os.environ.items()) if k.startswith("MHC_BACKEND") or k == "MHC_CUTILE_TUNING"
    }
    known = {dispatch.ENV_ALL, *(dispatch.env_var(op) for op in dispatch.OPS)}
    for var in (k for k in env if k.startswith("MHC_BACKEND") and k not in known):  # ignored by the dispatch
        close = difflib.get_close_matches(var, sorted(known), n=1)
        problems.append(
            f"{var} is not a variable the dispatch reads (it is ignored)"
            + (f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(sorted(known))}")
        )
    if device == "cuda" and not torch.cuda.is_available():
        notes.append("no CUDA device on this machine: this describes the dispatch's choices only")
    pre_plan = next(p for p in plans if p.op == "pre")
    if device == "cpu" and pre_plan.runs_on == "compiled":
        from mhc_core.kernels import native

        try:
            ok, why = native.available()
        except ValueError as exc:  # an MHC_NATIVE naming no kernel, or one this CPU lacks
            ok, why = False, str(exc)
            problems.append(str(exc))
        act = _DTYPES[dtype]
        compute = (
            torch.float32 if spec.mapping_fp32 else act
        )  # the mapping's dtype, as the compiled pre has it
        native_fwd, native_bwd = native.passes(act, compute, n, native.chosen_kernel() if ok else None)
        where = "its native kernel" if native_fwd else "its torch.compile graph"
        math = "fp32" if compute == torch.float32 else dtype
        reason = (
            why
            if not ok
            else (
                f"the mapping computes in {math}"
                if native_fwd
                else f"the native kernel reads no {dtype} activations"
                if act not in (torch.float32, torch.bfloat16)
                else f"n > {native.MAX_N}"
            )
        )
        backward = (
            "the native kernel's passes over x"
            if native_bwd
            else "its torch.compile graph" + (" (bf16 GEMMs)" if native_fwd else "")
        )
        notes.append(
            f"pre's forward runs {where} ({reason}), its backward {backward}; MHC_NATIVE=0 turns the "
            f"native kernels off, MHC_NATIVE=<kernel> picks one of "
            f"{', '.join(native.kernels()) or 'none here'}"
        )
    return Preflight(
        device=device,
        gpu_name=gpu_name,
        torch=torch.__version__,
        n=n,
        dtype=dtype,
        dropout=dropout,
        variant=spec.variant.value,
        ops=plans,
        backends=backends,
        environment=env,
        cutile_tuning=described,
        problems=tuple(problems),
        notes=tuple(notes),
    )


def format_text(p: Preflight) -> str:
    """The report as aligned text (what `python -m mhc_core.kernels` prints)."""
    gpu = f" ({p.gpu_name})" if p.gpu_name and p.device == "cuda" else ""
    lines = [
        f"mHC kernels for tensors on {p.device}{gpu}: torch {p.torch}, n = {p.n}, {p.dtype} activations, "
        f"hidden dropout {p.dropout:g}, {p.variant}"
    ]
    width = max(len(o.op) for o in p.ops)
    for o in p.ops:
        how = f"forced by {o.set_by}" if o.set_by else "auto"
        if not o.ok:
            where = "its first call raises (see PROBLEM)"
        elif o.runs_on != o.backend:
            where = f"{o.runs_on} ({how}: {o.why})"
        else:
            where = f"{o.backend} ({how})"
        lines.append(f"  {o.op:<{width}}  {where}")
    lines.append("backends:")
    for b, a in p.backends.items():
        lines.append(f"  {b:<9}  {'available' if a['available'] else 'unavailable'}: {a['reason']}")
    if p.cutile_tuning is not None:
        lines.append(f"cuTile tuning{f' for {p.gpu_name}' if p.gpu_name else ''}: {p.cutile_tuning}")
    env = ", ".join(f"{k}={v}" for k, v in p.environment.items())
    lines.append(f"environment: {env or 'no MHC_BACKEND* / MHC_CUTILE_TUNING set'}")
    lines += [f"note: {x}" for x in p.notes]
    lines += [f"PROBLEM: {x}" for x in p.problems] or ["ok: the first mHC call of such a run does not raise"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhc_core.kernels", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), help="where the tensors live (default: cuda if present)"
    )
    ap.add_argument("--gpu-name", help="device name for the shipped cuTile tuning (default: this GPU's)")
    ap.add_argument("--n", type=int, default=4, help="residual streams (default 4)")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="activation dtype (default bf16)")
    ap.add_argument("--dropout", type=float, default=0.0, help="hidden dropout in training (default 0)")
    ap.add_argument(
        "--variant",
        default="megatron_main",
        choices=[v.value for v in Variant],
        help="numeric variant (default megatron_main)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        p = preflight(
            device=args.device,
            gpu_name=args.gpu_name,
            n=args.n,
            dtype=args.dtype,
            dropout=args.dropout,
            variant=args.variant,
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.json:
        doc = asdict(p)
        doc["ops"] = [{**asdict(o), "ok": o.ok} for o in p.ops]
        print(json.dumps({**doc, "ok": p.ok}, indent=2))
    else:
        print(format_text(p))
    return 0 if p.ok else 1
