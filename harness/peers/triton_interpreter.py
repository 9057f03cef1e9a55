"""Triton kernels on a machine without a GPU: Triton's interpreter, set up for the peers that need it.

Two things stand between a peer's Triton kernels and `TRITON_INTERPRET=1` on CPU tensors:

- the variable must be set before anything imports triton (transformers does): triton's own `@jit`
  library functions are decorated when triton imports, and a kernel interpreted afterwards cannot call
  them (`prepare_interpreter`);
- `@triton.autotune` times its configurations with the active driver's benchmarker, and the
  interpreter has no driver ("0 active drivers"). Interpreted timings would mean nothing anyway, so
  `without_autotune_timing` gives a module's autotuners a benchmarker that times nothing: each keeps
  the first of its (pruned) configurations, deterministically. A configuration changes the launch
  (warps, stages, block sizes), not what the kernel computes; where a peer's configurations differ in
  their reduction split, the first one is what is checked;
- a configuration pruner may read the device's properties from the active driver (TransformerEngine's
  projection backward keeps the configurations whose shared memory fits): `device_properties` stands
  in a driver that answers only that, with a named GPU's values, while the peer's op runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType

import torch

__all__ = [
    "H100_PROPERTIES",
    "INTERPRET_ENV_VAR",
    "StandInDriver",
    "device_properties",
    "interpreted",
    "prepare_interpreter",
    "without_autotune_timing",
]

INTERPRET_ENV_VAR = "TRITON_INTERPRET"


def interpreted() -> bool:
    """True where Triton kernels run through the interpreter (no CUDA device)."""
    return not torch.cuda.is_available()


def prepare_interpreter() -> str | None:
    """Without a GPU, set `TRITON_INTERPRET=1` if triton is not imported yet; returns why the kernels cannot
    run (triton imported first, or the variable set to something else), or None."""
    if not interpreted():
        return None
    value = os.environ.get(INTERPRET_ENV_VAR)
    if value is None and "triton" in sys.modules:
        return (
            f"no GPU, and triton was imported before {INTERPRET_ENV_VAR}=1 was set (its library functions are "
            f"then compiled-only); run with {INTERPRET_ENV_VAR}=1 in the environment"
        )
    if value is None:
        os.environ[INTERPRET_ENV_VAR] = "1"
        return None
    return None if value == "1" else f"no GPU and {INTERPRET_ENV_VAR}={value!r}: the kernels cannot run"


def _no_timing(kernel_call, quantiles):  # noqa: ANN001, ARG001 - triton's do_bench signature
    """Equal (zero) timings for every configuration: the autotuner keeps its first."""
    return [0.0] * len(quantiles)


def without_autotune_timing(module: ModuleType) -> int:
    """Give every `@triton.autotune` kernel among `module`'s globals the timing-free benchmarker; returns
    how many. Only under the interpreter (a GPU times its configurations as usual: returns 0)."""
    if not interpreted():
        return 0
    from triton.runtime.autotuner import Autotuner

    tuners = [obj for obj in vars(module).values() if isinstance(obj, Autotuner)]
    for tuner in tuners:
        tuner.__dict__["do_bench"] = _no_timing  # do_bench is a cached_property: the instance's value wins
    return len(tuners)


H100_PROPERTIES: Mapping[str, int] = MappingProxyType({"max_shared_mem": 232448, "multiprocessor_count": 132})
"""What a pruner may ask of an H100 / H200 (sm_90: 227 KiB of shared memory per block, opt-in; 132 SMs)."""


@dataclass(frozen=True, kw_only=True)
class StandInDriver:
    """The part of a Triton driver a configuration pruner reads: `utils.get_device_properties(device)` and
    `get_current_device()`. Nothing launches through it (the interpreter runs the kernels)."""

    properties: Mapping[str, int] = field(default_factory=lambda: H100_PROPERTIES)

    @property
    def utils(self) -> StandInDriver:
        return self

    def get_device_properties(self, device: int) -> dict[str, int]:  # noqa: ARG002 - one device
        return dict(self.properties)

    def get_current_device(self) -> int:
        return 0


@contextlib.contextmanager
def device_properties(properties: Mapping[str, int] = H100_PROPERTIES) -> Iterator[None]:
    """Under the interpreter, make `triton.runtime.driver.active` a `StandInDriver` with
    `properties` for the duration (the previous one, usually none, is restored); elsewhere do nothing."""
    if not interpreted():
        yield
        return
    import triton.runtime

    config = triton.runtime.driver  # a DriverConfig: `active` falls back to creating the default driver
    saved = config._active
    config.set_active(StandInDriver(properties=properties))
    try:
        yield
    finally:
        config._active = saved  # not reset_active(): that would create the default driver, which fails here
