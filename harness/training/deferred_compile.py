"""`torch.compile` applied at a function's first call instead of at its decoration, in a rank process.

megatron-core decorates its fused functions with `jit_fuser`, which is `torch.compile` on torch >=
2.2: the first decoration imports TorchDynamo and Inductor (about 1.4 s of a rank's 4 s start-up on a
2-core box) although a CPU rank of this suite never calls most of them. `defer_compile()` makes
`torch.compile(fn)` return a wrapper that calls the real `torch.compile(fn, ...)` on the first call and
the compiled function from then on, which is what `torch.compile` does anyway (it compiles at the first
call): what runs is unchanged, only the import moves to where a compile happens. Modules, and the
`torch.compile(**options)` decorator factory applied to modules, go to the real `torch.compile`.

Only the entry points of this suite's own CPU rank processes (`suites/pp/pp_worker.py`,
`harness/training/worker.py` without CUDA) install it, before anything imports megatron-core; `mhc_core`
never does (a compiled region that traces into a deferred function would meet the `torch.compile` call
inside it, where the real decoration is inlined).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["defer_compile", "deferred"]

_REAL = torch.compile


def deferred(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """`fn` compiled with `torch.compile(fn, **options)` at its first call."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(_REAL(fn, **options))
        return compiled[0](*args, **kwargs)

    return call


def _compile(model: Any = None, **options: Any) -> Any:
    if model is None:  # used as `@torch.compile(**options)`
        return lambda m: _compile(m, **options)
    if isinstance(model, types.FunctionType):
        return deferred(model, **options)
    return _REAL(model, **options)


def defer_compile() -> None:
    """Install the deferred `torch.compile` for the rest of this process (idempotent)."""
    torch.compile = _compile
