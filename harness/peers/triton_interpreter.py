"""Triton kernels on a machine without a GPU: Triton's interpreter, set up for the peers that need it.

Two things stand between a peer's Triton kernels and ``TRITON_INTERPRET=1`` on CPU tensors:

- the variable must be set before anything imports triton (transformers does): triton's own ``@jit``
  library functions are decorated when triton imports, and a kernel interpreted afterwards cannot call
  them (``prepare_interpreter``);
- ``@triton.autotune`` times its configurations with the active driver's benchmarker, and the
  interpreter has no driver ("0 active drivers"). Interpreted timings would mean nothing anyway, so
  ``without_autotune_timing`` gives a module's autotuners a benchmarker that times nothing: each keeps
  the first of its (pruned) configurations, deterministically. A configuration changes the launch
  (warps, stages, block sizes), not what the kernel computes; where a peer's configurations differ in
  their reduction split, the first one is what is checked.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

__all__ = ["INTERPRET_ENV_VAR", "interpreted", "prepare_interpreter", "without_autotune_timing"]

INTERPRET_ENV_VAR = "TRITON_INTERPRET"


def interpreted() -> bool:
    """True where Triton kernels run through the interpreter (no CUDA device)."""
    return not torch.cuda.is_available()


def prepare_interpreter() -> str | None:
    """Without a GPU, set ``TRITON_INTERPRET=1`` if triton is not imported yet; returns why the kernels cannot
    run (triton imported first, or the variable set to something else), or None."""
    if not interpreted():
        return None
    value = os.environ.get(INTERPRET_ENV_VAR)
    if value is None and "triton" in sys.modules:
        return (f"no GPU, and triton was imported before {INTERPRET_ENV_VAR}=1 was set (its library functions are "
                f"then compiled-only); run with {INTERPRET_ENV_VAR}=1 in the environment")
    if value is None:
        os.environ[INTERPRET_ENV_VAR] = "1"
        return None
    return None if value == "1" else f"no GPU and {INTERPRET_ENV_VAR}={value!r}: the kernels cannot run"


def _no_timing(kernel_call, quantiles):  # noqa: ANN001, ARG001 - triton's do_bench signature
    """Equal (zero) timings for every configuration: the autotuner keeps its first."""
    return [0.0] * len(quantiles)


def without_autotune_timing(module: ModuleType) -> int:
    """Give every ``@triton.autotune`` kernel among ``module``'s globals the timing-free benchmarker; returns
    how many. Only under the interpreter (a GPU times its configurations as usual: returns 0)."""
    if not interpreted():
        return 0
    from triton.runtime.autotuner import Autotuner

    tuners = [obj for obj in vars(module).values() if isinstance(obj, Autotuner)]
    for tuner in tuners:
        tuner.__dict__["do_bench"] = _no_timing  # do_bench is a cached_property: the instance's value wins
    return len(tuners)
