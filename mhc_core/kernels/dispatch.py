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

import logging
import os
import threading
from collections.abc import Callable

import torch

from mhc_core import ops as _reference
from mhc_core.ops.mapping import NORM_EPS
from mhc_core.variants import Variant

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
    "get_impl",
    "reset",
    "sinkhorn",
    "mapping",
    "h_aggregate",
    "h_post_bda",
    "pre",
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


def get_impl(op: str, backend: str) -> Callable:
    """The implementation of `op` in `backend` (imports the backend module lazily)."""
    _check_op(op)
    if backend == "reference":
        return getattr(_reference, op)
    if backend == "compiled":
        from mhc_core.kernels import compiled

        return getattr(compiled, op)
    if backend == "cutile":
        from mhc_core.kernels import cutile

        return getattr(cutile, op)
    raise ValueError(f"mhc_core.kernels: backend={backend!r} is unknown; valid: {', '.join(BACKENDS)}")


def _log_once(op: str, backend: str, reason: str) -> None:
    key = (op, backend)
    if key in _LOGGED:
        return
    with _LOCK:
        first = key not in _LOGGED
        _LOGGED.add(key)
    if first:
        logger.info("mHC op %s uses backend %s (%s)", op, backend, reason)


def _run(op: str, tensor: object, *args):
    """Call `op` on its backend; under `auto`, a call cutile does not cover goes to the next backend."""
    device = tensor.device if isinstance(tensor, torch.Tensor) else None
    backend, reason, auto = _resolve(op, device)
    _log_once(op, backend, reason)
    impl = get_impl(op, backend)
    if not (auto and backend == "cutile"):
        return impl(*args)
    try:
        return impl(*args)
    except NotImplementedError as exc:
        fallback, why = without_cutile(device, f"it does not cover this call: {exc}")
        _log_once(op, fallback, why)
        return get_impl(op, fallback)(*args)


def reset() -> None:
    """Forget cached availabilities and the once-per-(op, backend) log record (for tests)."""
    with _LOCK:
        _AVAILABILITY.clear()
        _LOGGED.clear()
    from mhc_core.kernels.compiled.common import availability as compiled_availability

    compiled_availability.cache_clear()


# --- the dispatched ops: the reference signatures, resolved at every call ---------------------------


def sinkhorn(logits, iterations=20, eps=None, variant=Variant.MEGATRON_MAIN):
    """Dispatched `mhc_core.ops.sinkhorn`: `logits [..., n, n] -> [..., n, n]`."""
    return _run("sinkhorn", logits, logits, iterations, eps, variant)


def mapping(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant=Variant.MEGATRON_MAIN, norm_eps=NORM_EPS):
    """Dispatched `mhc_core.ops.mapping`: `x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`."""
    return _run("mapping", x, x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant, norm_eps)


def h_aggregate(x, h_pre):
    """Dispatched `mhc_core.ops.h_aggregate`: `x [T, n, C], h_pre [T, n] -> [T, C]`."""
    return _run("h_aggregate", x, x, h_pre)


def h_post_bda(h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=Variant.MEGATRON_MAIN):
    """Dispatched `mhc_core.ops.h_post_bda`: `-> [T, n, C]`."""
    return _run("h_post_bda", residual, h_res, residual, h_post, y, bias, dropout_p, training, variant)


def pre(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations=20, variant=Variant.MEGATRON_MAIN,
        norm_eps=NORM_EPS):
    """Dispatched `mhc_core.ops.pre`: `x [T, n*C] -> aggregate [T, C], h_pre [T, n], h_post [T, n], h_res [T, n, n]`."""
    return _run("pre", x, x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, variant, norm_eps)
