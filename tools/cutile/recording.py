"""Record the launches the cuTile wrappers would make, instead of running them (no GPU, no `cuda.tile`).

`RecordingRuntime` is the source of the CI signature list (`signatures.py`) and the precompile plan:
it keeps each launch's kernel and abstract arguments (`ArrayArg`, `ScalarArg`, `ConstArg`) the way
the cuTile JIT specialises them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from tools.cutile.emulator import ConstantAnnotation, emulated_kernels

__all__ = ["ArrayArg", "ScalarArg", "ConstArg", "Launch", "RecordingRuntime"]


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
    """Records launches (kernel, argument kinds) instead of running them; outputs stay empty."""

    def __init__(self, num_sms: int = 132) -> None:
        self._sms = num_sms
        self._params = {
            name: list(inspect.signature(kernel, eval_str=True).parameters.values())
            for name, (kernel, _) in emulated_kernels().items()
        }
        self.label = ""
        self.launches: list[Launch] = []

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple[Any, ...]) -> None:
        params = self._params[kernel_name]
        if len(params) != len(args):
            raise TypeError(f"{kernel_name}: {len(args)} arguments for {len(params)} parameters")
        abstract = []
        for p, a in zip(params, args, strict=True):
            if p.annotation is ConstantAnnotation:  # `ct.Constant[...]` under the interpreter
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
