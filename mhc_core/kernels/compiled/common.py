"""Shared machinery of the `compiled` backend: availability, one compile per static key, dynamic tokens.

Compile policy (see `docs/kernels.md`):

- Every fused function is compiled with `torch.compile(dynamic=False, fullgraph=True)`: a graph
  break is an error, never a silent split into eager pieces. Python floats (eps) are specialised.
- Each static configuration (op, variant, n, dtypes, flags) gets its *own* compiled function with
  its own code object, so Dynamo's per-code recompile limit counts shapes of one configuration
  only, never configurations against each other.
- The token dim is marked dynamic (`maybe_mark_dynamic`), so a varying token count reuses one
  graph: one graph for T >= 2 plus one specialised graph for T = 1 (Dynamo always specialises
  sizes 0 and 1; T = 0 never reaches a compiled function, the ops short-circuit to the
  reference). The remaining static dims (n, C) come from the model config and do not vary.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Callable, Hashable
from typing import overload

import torch

__all__ = ["availability", "compile_for", "mark_dynamic", "acc_dtype", "compiled_cache_size"]

_COMPILED: dict[tuple[Hashable, ...], Callable] = {}


@functools.cache
def availability(device_type: str = "cpu") -> tuple[bool, str]:
    """Whether torch.compile (Dynamo + Inductor) can build kernels for `device_type`, and why."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported
    except Exception as exc:  # pragma: no cover - torch without dynamo
        return False, f"torch._dynamo is not importable: {exc}"
    if not is_dynamo_supported():
        return False, f"torch.compile is not supported on this Python/platform (torch {torch.__version__})"
    if device_type == "cpu":
        try:
            from torch._inductor import cpp_builder

            compiler = cpp_builder.get_cpp_compiler()
        except Exception as exc:
            return False, f"Inductor's CPU backend needs a C++ compiler: {exc}"
        return True, f"torch.compile (Inductor C++/OpenMP, {compiler})"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        if not has_triton():
            return False, "Inductor's CUDA backend needs Triton, which is not importable"
        return True, "torch.compile (Inductor Triton)"
    return False, f"device type {device_type!r} is not supported by the compiled backend (cpu, cuda)"


def _slug(key: tuple[Hashable, ...]) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", "_".join(str(k) for k in key)).strip("_")[:120]


def compile_for(fn: Callable, key: tuple[Hashable, ...]) -> Callable:
    """`torch.compile(fn)` for one static configuration `key`, built once and cached.

    The compiled function wraps a copy of `fn` with its own code object (named after `key`), so
    Dynamo's compile cache and recompile limit are per configuration.
    """
    cache_key = (fn.__module__, fn.__qualname__, *key)
    compiled = _COMPILED.get(cache_key)
    if compiled is None:
        name = f"{fn.__name__}__{_slug(key)}"
        code = fn.__code__.replace(co_name=name, co_qualname=name)
        clone = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        clone.__kwdefaults__ = fn.__kwdefaults__
        # Floats (eps) are part of `key`: specialise them, so a float never becomes a graph input.
        compiled = torch._dynamo.config.patch(specialize_float=True)(
            torch.compile(clone, dynamic=False, fullgraph=True)
        )
        _COMPILED[cache_key] = compiled
    return compiled


def compiled_cache_size() -> int:
    """How many (function, configuration) pairs have been compiled in this process."""
    return len(_COMPILED)


@overload
def mark_dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor: ...


@overload
def mark_dynamic(t: None, *dims: int) -> None: ...


def mark_dynamic(t: torch.Tensor | None, *dims: int) -> torch.Tensor | None:
    """An alias of `t` (a `detach()`, so the caller's tensor is never tagged) whose `dims` may vary
    without a recompile; None stays None. Sizes Dynamo specialises (0, 1) still specialise."""
    if t is None:
        return None
    alias = t.detach()
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(alias, d)
    return alias


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the reference ops: the promotion of `dtypes` and fp32."""
    acc = torch.float32
    for dt in dtypes:
        acc = torch.promote_types(acc, dt)
    return acc
