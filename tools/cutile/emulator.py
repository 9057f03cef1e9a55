"""A CPU interpreter for `mhc_core.kernels.cutile`'s kernels (torch ops in place of `cuda.tile`).

cuTile has no simulator, so without a GPU the kernels can only be compiled. This module runs the
same kernel source with a small stand-in for the `cuda.tile` API subset the kernels use, block by
block, on torch tensors of any device. It checks the kernels' algorithm and indexing (tile-space
loads and stores, padding, the variants' recompute order, the split reductions) against the
reference ops on a machine without a GPU; what it cannot check is the compiler and the hardware.

The `cuda.tile` stand-in and the semantics it emulates are in `emulated_tile.py`; this module
loads a kernel module with it and runs launches block by block. Launch semantics:
- Runtime scalar arguments (not `ct.Constant`) are int32 / float32 on the device: floats are
  rounded to fp32 and ints must fit in int32 (`ct.ScalarInt64` would be needed otherwise).
- Grid: at most 3 dimensions of at most 2**24 - 1 blocks each (`_cext` launch check).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import struct
import sys
import types
from pathlib import Path
from typing import Any

import torch

from mhc_core.kernels.cutile.runtime import KERNEL_MODULES
from tools.cutile.emulated_tile import ConstantAnnotation, EmulatedTile

__all__ = ["EmulatedTile", "EmulatedRuntime", "load_kernel_module", "emulated_kernels", "emulate_launch"]

_MAX_GRID = 2**24 - 1
"""cuTile's launch rejects a grid dimension above 2**24 - 1 ("Grid[i] exceeds 24-bit limit")."""


def _fp32_scalar(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


_MODULE_CACHE: dict[str, tuple[types.ModuleType, EmulatedTile]] = {}

_PACKAGE = "mhc_core.kernels.cutile"
HELPER_MODULES = ("mma",)
"""Modules of this package that kernel modules import helpers from and that use `cuda.tile`
themselves: a kernel module loaded here imports their emulated copies (with the stand-in). In
dependency order: a helper may import the helpers before it. Helpers must not read the launch
state (`ct.bid`, `ct.num_blocks`): each module has its own stand-in."""


def load_kernel_module(name: str) -> tuple[types.ModuleType, EmulatedTile]:
    """Import `mhc_core.kernels.cutile.<name>` with an `EmulatedTile` bound as `cuda.tile` (and
    the emulated `HELPER_MODULES` in place of the real ones while it loads)."""
    if name in _MODULE_CACHE:
        return _MODULE_CACHE[name]
    deps = HELPER_MODULES[: HELPER_MODULES.index(name)] if name in HELPER_MODULES else HELPER_MODULES
    helpers = {f"{_PACKAGE}.{h}": load_kernel_module(h)[0] for h in deps}
    path = Path(importlib.import_module(_PACKAGE).__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{_PACKAGE}._emulated_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"emulator: cannot load kernel module {path}")
    module = importlib.util.module_from_spec(spec)
    shim = EmulatedTile()
    package = types.ModuleType("cuda")
    package.tile = shim  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("cuda", "cuda.tile", *helpers)}
    sys.modules["cuda"], sys.modules["cuda.tile"] = package, shim
    sys.modules.update(helpers)
    try:
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    _MODULE_CACHE[name] = (module, shim)
    return module, shim


def emulated_kernels() -> dict[str, tuple[Any, EmulatedTile]]:
    """Every kernel of `KERNEL_MODULES` as loaded here: `{name: (kernel function, its module's stand-in)}`."""
    out = {}
    for name, mod in KERNEL_MODULES.items():
        module, shim = load_kernel_module(mod)
        out[name] = (getattr(module, name), shim)
    return out


_CONST_PARAMS: dict[Any, tuple[bool, ...]] = {}


def _device_args(kernel, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` as the device sees them: runtime floats rounded to fp32, runtime ints in int32."""
    if kernel not in _CONST_PARAMS:
        params = inspect.signature(kernel, eval_str=True).parameters.values()
        _CONST_PARAMS[kernel] = tuple(p.annotation is ConstantAnnotation for p in params)
    out = []
    for is_const, a in zip(_CONST_PARAMS[kernel], args, strict=True):
        if not is_const and isinstance(a, float):
            a = _fp32_scalar(a)
        elif not is_const and isinstance(a, int) and not isinstance(a, bool) and not -(2**31) <= a < 2**31:
            raise OverflowError(
                f"emulator: scalar argument {a} does not fit in int32 (ct.ScalarInt64 needed)"
            )
        out.append(a)
    return tuple(out)


def emulate_launch(shim: EmulatedTile, grid: tuple[int, ...], kernel, args: tuple[Any, ...]) -> None:
    """Run `kernel(*args)` once per block of `grid`, in order (blocks never overlap in these kernels)."""
    if not 1 <= len(grid) <= 3 or any(not 0 <= int(g) <= _MAX_GRID for g in grid):
        raise ValueError(f"emulator: grid {tuple(grid)} (cuTile: 1 to 3 dimensions of at most {_MAX_GRID})")
    args = _device_args(kernel, args)
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    shim._grid = grid3
    for bid in itertools.product(*(range(g) for g in grid3)):
        shim._bid = bid
        kernel(*args)


class EmulatedRuntime:
    """Runs the kernel source on the CPU interpreter in this module (any device, slow)."""

    def __init__(self, num_sms: int = 4) -> None:
        self._sms = num_sms
        self._kernels = emulated_kernels()

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple[Any, ...]) -> None:
        kernel, shim = self._kernels[kernel_name]
        emulate_launch(shim, grid, kernel, args)

    def num_sms(self, device: torch.device) -> int:
        return self._sms

    @staticmethod
    def check_tensor(t: torch.Tensor, name: str, op: str) -> None:
        return None
