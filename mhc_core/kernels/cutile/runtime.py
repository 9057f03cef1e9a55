"""Where the cuTile launches go: the GPU, the CPU emulator, or a recorder.

The launch wrappers in `ops_*.py` call `runtime.launch(grid, kernel_name, args)` and never touch
`cuda.tile` themselves, so the same wrapper code
- runs on a GPU (`CuTileRuntime`: `ct.launch` on the current torch stream),
- runs on CPU through the kernel interpreter (`EmulatedRuntime`, tests without a GPU),
- or only records which kernels it would launch with which argument kinds
  (`RecordingRuntime`, the source of the CI signature list in `tools/cutile/signatures.py`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling

__all__ = [
    "KERNEL_MODULES",
    "kernel_object",
    "ArrayArg",
    "ScalarArg",
    "ConstArg",
    "Launch",
    "CuTileRuntime",
    "EmulatedRuntime",
    "RecordingRuntime",
]

KERNEL_MODULES: dict[str, str] = {
    "sinkhorn_fwd_kernel": "sinkhorn_kernels",
    "sinkhorn_bwd_kernel": "sinkhorn_kernels",
    "sinkhorn_fwd_elem_kernel": "sinkhorn_elem_kernels",
    "sinkhorn_bwd_elem_kernel": "sinkhorn_elem_kernels",
    "sinkhorn_fwd_checkpoint_kernel": "sinkhorn_elem_kernels",
    "sinkhorn_bwd_checkpoint_kernel": "sinkhorn_elem_kernels",
    "h_aggregate_fwd_kernel": "stream_kernels",
    "h_aggregate_bwd_kernel": "stream_kernels",
    "h_post_bda_fwd_kernel": "stream_kernels",
    "h_post_bda_bwd_kernel": "stream_kernels",
    "mapping_fwd_partial_kernel": "mapping_kernels",
    "mapping_fwd_epilogue_kernel": "mapping_kernels",
    "mapping_bwd_coef_kernel": "mapping_kernels",
    "mapping_bwd_dx_dw_kernel": "mapping_kernels",
    "mapping_bwd_dx_kernel": "mapping_kernels",
}
"""Every kernel of the package and the module (in this package) that defines it."""


_AS_TILING = object()


@functools.cache
def _hinted(kernel_name: str, occupancy: int | None):
    kernel = getattr(importlib.import_module(f"mhc_core.kernels.cutile.{KERNEL_MODULES[kernel_name]}"), kernel_name)
    return kernel if occupancy is None else kernel.replace_hints(occupancy=occupancy)


def kernel_object(kernel_name: str, occupancy: int | None | object = _AS_TILING):
    """The `@ct.kernel` object (imports `cuda.tile`) with an occupancy hint: `tiling.occupancy`'s
    (override, tuning, `DEFAULT_OCCUPANCY`) unless `occupancy` is given (None: no hint). The one
    place a hint becomes a kernel, for the GPU runtime, CI's offline compile, the resource report
    and the precompiled cache; each hinted copy is kept (it has its own JIT cache)."""
    return _hinted(kernel_name, tiling.occupancy(kernel_name) if occupancy is _AS_TILING else occupancy)


class CuTileRuntime:
    """Launches on the current CUDA stream with `cuda.tile.launch` (JIT-compiled per signature).
    `unchecked_loads`: whether its tileiras takes unchecked loads (`StreamTiles.unchecked`, >= 13.4)."""

    emulated = False

    def __init__(self) -> None:
        import cuda.tile as ct

        from mhc_core.kernels.cutile.toolchain import UNCHECKED_MIN_TILEIRAS, find_toolchain

        self._ct = ct
        tc = find_toolchain()
        self.unchecked_loads = tc is not None and tc.release >= UNCHECKED_MIN_TILEIRAS
        for name in KERNEL_MODULES:  # import every kernel module now: a broken one fails here, not mid-step
            kernel_object(name, None)

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple[Any, ...]) -> None:
        """Launch on the current stream of the device of the first tensor argument."""
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        kernel = self._kernel(kernel_name)
        if device.index is None or device.index == torch.cuda.current_device():
            self._ct.launch(torch.cuda.current_stream(device), grid, kernel, args)
        else:
            with torch.cuda.device(device):
                self._ct.launch(torch.cuda.current_stream(device), grid, kernel, args)

    def _kernel(self, kernel_name: str):
        """The kernel object with the occupancy hint in force (`kernel_object`)."""
        return kernel_object(kernel_name)

    @staticmethod
    def num_sms(device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count

    @staticmethod
    def check_tensor(t: torch.Tensor, name: str, op: str) -> None:
        if not t.is_cuda:
            raise NotImplementedError(
                f"cutile {op}: {name} is on {t.device}; the cuTile kernels run on CUDA tensors only"
            )


class EmulatedRuntime:
    """Runs the kernel source on the CPU interpreter in `emulator.py` (any device, slow); its `ct.load` /
    `ct.store` take unchecked accesses and raise for one that runs past its array."""

    emulated = True
    unchecked_loads = True

    def __init__(self, num_sms: int = 4) -> None:
        from mhc_core.kernels.cutile import emulator

        self._emulator = emulator
        self._sms = num_sms
        self._kernels = {}
        for name, mod in KERNEL_MODULES.items():
            module, shim = emulator.load_kernel_module(mod)
            self._kernels[name] = (getattr(module, name), shim)

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple[Any, ...]) -> None:
        kernel, shim = self._kernels[kernel_name]
        self._emulator.emulate_launch(shim, grid, kernel, args)

    def num_sms(self, device: torch.device) -> int:
        return self._sms

    @staticmethod
    def check_tensor(t: torch.Tensor, name: str, op: str) -> None:
        return None


@dataclass(frozen=True)
class ArrayArg:
    """An array argument as the cuTile JIT specialises it (see `ArrayConstraint`)."""

    dtype: torch.dtype
    ndim: int
    base_16: bool
    stride_one: tuple[bool, ...]
    stride_div: tuple[int, ...]
    shape_16: tuple[bool, ...]
    shape_one: tuple[bool, ...] = ()
    """Dims of size 1, which the JIT specialises as constants (`shape_constant`, calling convention v2);
    empty when none is."""

    @property
    def layout(self) -> tuple:
        """What selects the kernel's code path: dtype, rank, unit strides (not the divisibility hints)."""
        return (self.dtype, self.ndim, self.stride_one)

    @classmethod
    def of(cls, t: torch.Tensor) -> ArrayArg:
        item = t.element_size()
        return cls(
            dtype=t.dtype,
            ndim=t.dim(),
            base_16=t.data_ptr() % 16 == 0,
            stride_one=tuple(s == 1 for s in t.stride()),
            stride_div=tuple(16 // item if (s * item) % 16 == 0 and s != 1 else 1 for s in t.stride()),
            shape_16=tuple(d % 16 == 0 for d in t.shape),
            shape_one=tuple(d == 1 for d in t.shape) if 1 in t.shape else (),
        )


@dataclass(frozen=True)
class ScalarArg:
    """A runtime scalar: `int` -> int32, `float` -> float32 (cuTile's defaults)."""

    kind: str


@dataclass(frozen=True)
class ConstArg:
    """A `ct.Constant` parameter and its value."""

    value: int | float | bool


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the context label, the kernel and its abstract arguments."""

    label: str
    kernel_name: str
    args: tuple[ArrayArg | ScalarArg | ConstArg, ...]


class RecordingRuntime:
    """Records launches (kernel, argument kinds) instead of running them; outputs stay empty. It records
    unchecked loads as a runtime with tileiras >= 13.4 launches them (what the CI and precompile
    toolchain, 13.4, compiles)."""

    emulated = True
    unchecked_loads = True

    def __init__(self, num_sms: int = 132) -> None:
        from mhc_core.kernels.cutile import emulator

        self._sms = num_sms
        self._params: dict[str, list[inspect.Parameter]] = {}
        self._constant = emulator.ConstantAnnotation  # what `ct.Constant[...]` annotations are under the interpreter
        for name, mod in KERNEL_MODULES.items():
            module, _ = emulator.load_kernel_module(mod)
            self._params[name] = list(inspect.signature(getattr(module, name), eval_str=True).parameters.values())
        self.label = ""
        self.launches: list[Launch] = []

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple[Any, ...]) -> None:
        params = self._params[kernel_name]
        if len(params) != len(args):
            raise TypeError(f"{kernel_name}: {len(args)} arguments for {len(params)} parameters")
        abstract = []
        for p, a in zip(params, args, strict=True):
            if p.annotation is self._constant:
                abstract.append(ConstArg(a))
            elif isinstance(a, torch.Tensor):
                abstract.append(ArrayArg.of(a))
            elif isinstance(a, bool | int):
                abstract.append(ScalarArg("int32"))
            elif isinstance(a, float):
                abstract.append(ScalarArg("float32"))
            else:
                raise TypeError(f"{kernel_name}: unsupported argument {p.name}={a!r}")
        self.launches.append(Launch(self.label, kernel_name, tuple(abstract)))

    def num_sms(self, device: torch.device) -> int:
        return self._sms

    @staticmethod
    def check_tensor(t: torch.Tensor, name: str, op: str) -> None:
        return None
