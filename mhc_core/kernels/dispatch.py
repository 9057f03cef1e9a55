"""One dispatch per mHC op over the backends `reference`, `compiled` and `cutile`.

Selection, per op, from the environment (read at every call, so a test or a launcher can change it):

    MHC_BACKEND_<OP>   e.g. MHC_BACKEND_SINKHORN, MHC_BACKEND_PRE   (wins over MHC_BACKEND)
    MHC_BACKEND        all ops
    values             auto | reference | compiled | cutile              (default auto)

`auto` picks `cutile` when it is available for the tensors' device, else `compiled`, else
`reference`; a call that cutile does not cover (it raises `NotImplementedError`, e.g. n = 3,
fp64, dropout while training) runs on the next backend, logged once. A forced backend that is
unavailable raises `BackendUnavailableError` naming the op, the backend, the variable that forced
it and the reason: never a silent fallback (and a forced cutile's `NotImplementedError`
propagates). The choice is logged once per (op, backend) on `logging.getLogger("mhc_core.kernels")`
at INFO. `python -m mhc_core.kernels` (`preflight`) reports these choices before a run.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mhc_core import ops
from mhc_core.ops import REFERENCE, AggregateCall, Backend, MappingCall, PostBdaCall, PreCall, SinkhornCall

__all__ = [
    "OPS",
    "BACKENDS",
    "CHOICES",
    "ENV_ALL",
    "BackendUnavailableError",
    "env_var",
    "availability",
    "resolve_backend",
    "resolve",
    "requested",
    "without_cutile",
    "backend_report",
    "BoundOps",
    "bound_ops",
    "get_backend",
    "op_on",
    "reset",
    "DISPATCH",
    "Dispatch",
]

logger = logging.getLogger("mhc_core.kernels")

OPS = ("sinkhorn", "mapping", "h_aggregate", "h_post_bda", "pre")
BACKENDS = ("reference", "compiled", "cutile")
CHOICES = ("auto", *BACKENDS)
ENV_ALL = "MHC_BACKEND"


class BackendUnavailableError(RuntimeError):
    """A backend forced for an op (by an environment variable) cannot run here."""


def env_var(op: str) -> str:
    """The per-op override variable, e.g. `MHC_BACKEND_SINKHORN`."""
    _check_op(op)
    return f"{ENV_ALL}_{op.upper()}"


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"mhc_core.kernels: op={op!r} is not an mHC op; valid: {', '.join(OPS)}")


def requested(op: str) -> tuple[str, str | None]:
    """(choice, the variable that set it, or None for the default `auto`) for `op`; `ValueError` for an
    invalid value."""
    for var in (env_var(op), ENV_ALL):
        raw = os.environ.get(var)
        if raw is None or raw.strip() == "":
            continue
        choice = raw.strip().lower()
        if choice not in CHOICES:
            raise ValueError(f"{var}={raw!r} is not a valid mHC backend; valid: {', '.join(CHOICES)}")
        return choice, var
    return "auto", None


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


_AVAILABILITY: dict[tuple[str, str], tuple[bool, str]] = {}
_LOGGED: set[tuple[str, str]] = set()
_LOCK = threading.Lock()


def _cutile_availability(device_type: str) -> tuple[bool, str]:
    if device_type != "cuda":
        return False, f"cutile runs on CUDA tensors only (device type {device_type!r})"
    try:
        from mhc_core.kernels import cutile
    except ImportError as exc:
        return False, f"mhc_core.kernels.cutile is not part of this build: {exc}"
    try:
        ok, reason = cutile.availability()
    except Exception as exc:  # a probe failure is a reason, not a crash
        return False, f"mhc_core.kernels.cutile failed to load: {type(exc).__name__}: {exc}"
    return bool(ok), str(reason)


def _compute_availability(backend: str, device_type: str) -> tuple[bool, str]:
    if backend == "reference":
        return True, "eager PyTorch reference (mhc_core.ops)"
    if backend == "compiled":
        from mhc_core.kernels.compiled.common import availability as compiled_availability

        return compiled_availability(device_type)
    return _cutile_availability(device_type)


def availability(backend: str, device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether `backend` can run ops on `device` (default: cuda if present, else cpu), and why; cached."""
    if backend not in BACKENDS:
        raise ValueError(f"mhc_core.kernels: backend={backend!r} is unknown; valid: {', '.join(BACKENDS)}")
    key = (backend, _device_type(device))
    with _LOCK:
        cached = _AVAILABILITY.get(key)
    if cached is None:
        cached = _compute_availability(*key)
        with _LOCK:
            _AVAILABILITY[key] = cached
    return cached


def _auto(device: torch.device | str | None, skip_cutile: str | None = None) -> tuple[str, str]:
    if skip_cutile is None:
        ok, why_cutile = availability("cutile", device)
        if ok:
            return "cutile", f"auto: {why_cutile}"
    else:
        why_cutile = skip_cutile
    ok, why_compiled = availability("compiled", device)
    if ok:
        return "compiled", f"auto: cutile unavailable ({why_cutile}); {why_compiled}"
    return "reference", f"auto: cutile unavailable ({why_cutile}); compiled unavailable ({why_compiled})"


def without_cutile(device: torch.device | str | None, why: str) -> tuple[str, str]:
    """(backend, reason) `auto` runs a call on when cutile does not cover it (`why`)."""
    return _auto(device, skip_cutile=why)


def _resolve(op: str, device: torch.device | str | None) -> tuple[str, str, bool]:
    _check_op(op)
    choice, var = requested(op)
    if choice == "auto":
        return (*_auto(device), True)
    ok, why = availability(choice, device)
    if not ok:
        raise BackendUnavailableError(
            f"mhc_core.kernels: op {op!r} is forced to backend {choice!r} by {var}={os.environ.get(var)!r}, "
            f"but {choice!r} is unavailable on device type {_device_type(device)!r}: {why}"
        )
    return choice, f"forced by {var}; {why}", False


def resolve(op: str, device: torch.device | str | None = None) -> tuple[str, str]:
    """(backend, reason) for `op` on `device`; `BackendUnavailableError` for a forced unavailable one."""
    backend, reason, _ = _resolve(op, device)
    return backend, reason


def resolve_backend(op: str, device: torch.device | str | None = None) -> str:
    """The backend `op` runs on for tensors on `device` (default: cuda if present, else cpu)."""
    return resolve(op, device)[0]


def backend_report(device: torch.device | str | None = None) -> dict[str, tuple[str, str]]:
    """`{op: (backend, reason)}` for every op; a forced unavailable backend is reported, not raised."""
    report: dict[str, tuple[str, str]] = {}
    for op in OPS:
        try:
            report[op] = resolve(op, device)
        except (BackendUnavailableError, ValueError) as exc:
            choice = _safe_choice(op)
            report[op] = (choice, f"unavailable: {exc}")
    return report


def _safe_choice(op: str) -> str:
    try:
        return requested(op)[0]
    except ValueError:
        return "invalid"


def get_backend(backend: str) -> Backend:
    """The backend object `backend` (`reference`, `compiled`, `cutile`; imports the backend module lazily)."""
    if backend == "reference":
        return REFERENCE
    if backend == "compiled":
        from mhc_core.kernels.compiled import COMPILED

        return COMPILED
    if backend == "cutile":
        from mhc_core.kernels.cutile import CUTILE

        return CUTILE
    raise ValueError(f"mhc_core.kernels: backend={backend!r} is unknown; valid: {', '.join(BACKENDS)}")


_ENTRIES: dict[str, Callable[..., Any]] = {
    "sinkhorn": ops.sinkhorn,
    "mapping": ops.mapping,
    "h_aggregate": ops.h_aggregate,
    "h_post_bda": ops.h_post_bda,
    "pre": ops.pre,
    "single_pass_pre": ops.single_pass_pre,
}
"""The public entry of each op (`mhc_core.ops`); `single_pass_pre` is `pre`'s call in the single-pass form (the
backend's `pre` computes it, `MHC_BACKEND_PRE` selects it)."""


def op_on(op: str, backend: str | Backend) -> Callable[..., Any]:
    """The public entry of `op` (`mhc_core.ops.<op>`, its signature; an op of `OPS` or `single_pass_pre`) computing
    on `backend` (a name or an object): for the tests and tools that pick ops by name."""
    if op not in _ENTRIES:
        _check_op(op)
    return functools.partial(
        _ENTRIES[op], backend=get_backend(backend) if isinstance(backend, str) else backend
    )


@dataclass(frozen=True)
class BoundOps:
    """The public entries bound to one backend (`bound_ops(CuTileBackend(runtime)).pre(x, weight, ...)`): the five
    ops and `single_pass_pre` (`pre` in the single-pass form)."""

    sinkhorn: Callable[..., Any]
    mapping: Callable[..., Any]
    h_aggregate: Callable[..., Any]
    h_post_bda: Callable[..., Any]
    pre: Callable[..., Any]
    single_pass_pre: Callable[..., Any]


def bound_ops(backend: str | Backend) -> BoundOps:
    """`BoundOps` of `backend` (a name or an object)."""
    return BoundOps(**{op: op_on(op, backend) for op in _ENTRIES})


def _log_once(op: str, backend: str, reason: str) -> None:
    key = (op, backend)
    if key in _LOGGED:
        return
    with _LOCK:
        first = key not in _LOGGED
        _LOGGED.add(key)
    if first:
        logger.info("mHC op %s uses backend %s (%s)", op, backend, reason)


R = TypeVar("R")


def _run(op: str, tensor: torch.Tensor, invoke: Callable[[Backend], R]) -> R:
    """`invoke(backend)` on `op`'s backend for tensors on `tensor`'s device; under `auto`, a call cutile does not
    cover goes to the next backend."""
    device = tensor.device
    backend, reason, auto = _resolve(op, device)
    _log_once(op, backend, reason)
    impl = get_backend(backend)
    if not (auto and backend == "cutile"):
        return invoke(impl)
    try:
        return invoke(impl)
    except NotImplementedError as exc:
        fallback, why = without_cutile(device, f"it does not cover this call: {exc}")
        _log_once(op, fallback, why)
        return invoke(get_backend(fallback))


def reset() -> None:
    """Forget cached availabilities and the once-per-(op, backend) log record (for tests)."""
    with _LOCK:
        _AVAILABILITY.clear()
        _LOGGED.clear()
    from mhc_core.kernels.compiled.common import availability as compiled_availability

    compiled_availability.cache_clear()


class Dispatch:
    """The per-op dispatch as a backend: each op runs on the backend `MHC_BACKEND[_<OP>]` selects for its tensors'
    device (the module docstring), called by symbol on it."""

    name = "dispatch"

    def sinkhorn(self, call: SinkhornCall) -> torch.Tensor:
        return _run("sinkhorn", call.logits, lambda b: b.sinkhorn(call))

    def mapping(self, call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _run("mapping", call.x, lambda b: b.mapping(call))

    def h_aggregate(self, call: AggregateCall) -> torch.Tensor:
        return _run("h_aggregate", call.x, lambda b: b.h_aggregate(call))

    def h_post_bda(self, call: PostBdaCall) -> torch.Tensor:
        return _run("h_post_bda", call.residual, lambda b: b.h_post_bda(call))

    def pre(self, call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _run("pre", call.x, lambda b: b.pre(call))


DISPATCH: Backend = Dispatch()
"""The dispatched backend: what `use_fused` modules call."""
