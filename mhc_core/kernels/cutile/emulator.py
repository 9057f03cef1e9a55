"""A CPU interpreter for this package's cuTile kernels (torch ops in place of `cuda.tile`).

cuTile has no simulator, so without a GPU the kernels can only be compiled. This module runs the
same kernel source with a small stand-in for the `cuda.tile` API subset the kernels use, block by
block, on torch tensors of any device. It checks the kernels' algorithm and indexing (tile-space
loads and stores, padding, the variants' recompute order, the split reductions) against the
reference ops on a machine without a GPU; what it cannot check is the compiler and the hardware.

Emulated semantics (from the cuTile 1.7 documentation):
- `load(array, index, shape, order, padding_mode)`: tile `index` of the tile space of
  `array.permute(order)`; out-of-bounds elements read as zero; a tile entirely out of bounds
  or a tile dimension that is not a power of two raises.
- `store`: out-of-bounds elements are dropped; the tile dtype must equal the array dtype.
- `astype(x, tfloat32)`: fp32 rounded to 10 mantissa bits (round to nearest even);
  `mma(a, b, acc)`: exact products of the (already rounded) operands, fp32 accumulation.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
import types
from pathlib import Path
from typing import Any

import torch

__all__ = ["EmulatedTile", "load_kernel_module", "emulate_launch"]


class _ConstantAnnotation:
    """`ct.Constant[int]` in an annotation."""

    def __class_getitem__(cls, item):
        return cls


class _PaddingMode:
    ZERO = "zero"
    UNDETERMINED = "undetermined"


class _TF32:
    """Marker dtype for `ct.tfloat32`."""

    def __repr__(self) -> str:
        return "tfloat32"


def _is_pow2(v: int) -> bool:
    return v >= 1 and (v & (v - 1)) == 0


def _round_tf32(t: torch.Tensor) -> torch.Tensor:
    bits = t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    lsb = (bits >> 13) & 1
    bits = ((bits + 0xFFF + lsb) >> 13) << 13
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _perm(order, ndim: int) -> tuple[int, ...]:
    if order == "C":
        return tuple(range(ndim))
    if order == "F":
        return tuple(reversed(range(ndim)))
    return tuple(order)


def _region(view: torch.Tensor, index, shape) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    if len(index) != view.dim() or len(shape) != view.dim():
        raise ValueError(f"emulator: index {tuple(index)} / shape {tuple(shape)} do not match an array of rank {view.dim()}")
    src, dst = [], []
    for i, s, size in zip(index, shape, view.shape, strict=True):
        if not _is_pow2(int(s)):
            raise ValueError(f"emulator: tile dimension {s} is not a power of two")
        start = int(i) * int(s)
        stop = min(start + int(s), size)
        if start >= size or int(i) < 0:
            raise ValueError(f"emulator: tile {tuple(index)} of shape {tuple(shape)} lies outside array {tuple(view.shape)}")
        src.append(slice(start, stop))
        dst.append(slice(0, stop - start))
    return tuple(src), tuple(dst)


class EmulatedTile(types.ModuleType):
    """The stand-in for `cuda.tile`; one instance per emulated launch context."""

    Constant = _ConstantAnnotation
    PaddingMode = _PaddingMode
    float32 = torch.float32
    float16 = torch.float16
    bfloat16 = torch.bfloat16
    float64 = torch.float64
    int32 = torch.int32
    int64 = torch.int64
    tfloat32 = _TF32()

    def __init__(self) -> None:
        super().__init__("cuda.tile")
        self._bid: tuple[int, ...] = (0, 0, 0)
        self._grid: tuple[int, ...] = (1, 1, 1)

    # -- decorators ---------------------------------------------------------------------------
    @staticmethod
    def kernel(fn=None, /, **_):
        return fn if fn is not None else (lambda f: f)

    @staticmethod
    def function(fn=None, /, **_):
        return fn if fn is not None else (lambda f: f)

    # -- grid ---------------------------------------------------------------------------------
    def bid(self, axis: int) -> int:
        return self._bid[axis]

    def num_blocks(self, axis: int) -> int:
        return self._grid[axis]

    # -- memory -------------------------------------------------------------------------------
    @staticmethod
    def load(array, index, shape, *, order="C", padding_mode=None, **_):
        view = array.permute(_perm(order, array.dim()))
        src, dst = _region(view, index, shape)
        out = torch.zeros(tuple(int(s) for s in shape), dtype=array.dtype, device=array.device)
        out[dst] = view[src]
        return out

    @staticmethod
    def store(array, index, tile, *, order="C", **_):
        tile = torch.as_tensor(tile)
        if tile.dtype != array.dtype:
            raise TypeError(f"emulator: storing a {tile.dtype} tile into a {array.dtype} array")
        view = array.permute(_perm(order, array.dim()))
        src, dst = _region(view, index, tile.shape)
        view[src] = tile[dst]

    @staticmethod
    def num_tiles(array, axis, shape, order="C"):
        view_shape = [array.shape[p] for p in _perm(order, array.dim())]
        return math.ceil(view_shape[axis] / shape[axis])

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def zeros(shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    @staticmethod
    def full(shape, fill_value, dtype):
        return torch.full(shape, fill_value, dtype=dtype)

    @staticmethod
    def arange(size, *, dtype):
        return torch.arange(size, dtype=dtype)

    # -- elementwise ----------------------------------------------------------------------------
    @staticmethod
    def astype(x, dtype):
        x = torch.as_tensor(x)
        if isinstance(dtype, _TF32):
            return _round_tf32(x)
        return x.to(dtype)

    @staticmethod
    def exp(x):
        return torch.exp(torch.as_tensor(x))

    @staticmethod
    def log(x):
        return torch.log(torch.as_tensor(x))

    @staticmethod
    def sqrt(x):
        return torch.sqrt(torch.as_tensor(x))

    @staticmethod
    def maximum(x, y):
        if isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            return torch.clamp_min(x, y)
        if isinstance(x, int | float) and isinstance(y, int | float):
            return max(x, y)
        return torch.maximum(torch.as_tensor(x), torch.as_tensor(y))

    @staticmethod
    def minimum(x, y):
        if isinstance(x, int | float) and isinstance(y, int | float):
            return min(x, y)
        return torch.minimum(torch.as_tensor(x), torch.as_tensor(y))

    @staticmethod
    def where(cond, x, y):
        return torch.where(cond, x, y)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    # -- reductions ---------------------------------------------------------------------------
    @staticmethod
    def sum(x, axis=None, *, keepdims=False):
        return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdims)

    @staticmethod
    def max(x, axis=None, *, keepdims=False):
        return x.amax() if axis is None else x.amax(dim=axis, keepdim=keepdims)

    # -- shape ----------------------------------------------------------------------------------
    @staticmethod
    def reshape(x, shape):
        return x.reshape(shape)

    @staticmethod
    def transpose(x, axis0=None, axis1=None):
        if axis0 is None:
            axis0, axis1 = x.dim() - 2, x.dim() - 1
        return x.transpose(axis0, axis1)

    @staticmethod
    def permute(x, axes):
        return x.permute(axes)

    @staticmethod
    def broadcast_to(x, shape):
        return x.expand(shape)

    @staticmethod
    def expand_dims(x, axis):
        return x.unsqueeze(axis)

    @staticmethod
    def cat(tiles, axis):
        out = torch.cat(tuple(tiles), dim=axis)
        if not all(_is_pow2(d) for d in out.shape):
            raise ValueError(f"emulator: cat result shape {tuple(out.shape)} is not a power of two")
        return out

    @staticmethod
    def extract(x, index, shape):
        sl = tuple(slice(int(i) * int(s), (int(i) + 1) * int(s)) for i, s in zip(index, shape, strict=True))
        out = x[sl]
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"emulator: extract {tuple(index)} of shape {tuple(shape)} out of tile {tuple(x.shape)}")
        return out

    @staticmethod
    def static_iter(iterable):
        return iterable

    # -- matrix -------------------------------------------------------------------------------
    @staticmethod
    def mma(x, y, acc):
        if acc.dtype != torch.float32:
            raise TypeError(f"emulator: mma accumulator must be fp32, got {acc.dtype}")
        prod = torch.matmul(x.to(torch.float64), y.to(torch.float64))
        return (acc.to(torch.float64) + prod).to(torch.float32)


_MODULE_CACHE: dict[str, tuple[types.ModuleType, EmulatedTile]] = {}


def load_kernel_module(name: str) -> tuple[types.ModuleType, EmulatedTile]:
    """Import `mhc_core.kernels.cutile.<name>` with an `EmulatedTile` bound as `cuda.tile`."""
    if name in _MODULE_CACHE:
        return _MODULE_CACHE[name]
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"mhc_core.kernels.cutile._emulated_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"emulator: cannot load kernel module {path}")
    module = importlib.util.module_from_spec(spec)
    shim = EmulatedTile()
    package = types.ModuleType("cuda")
    package.tile = shim  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("cuda", "cuda.tile")}
    sys.modules["cuda"], sys.modules["cuda.tile"] = package, shim
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


def emulate_launch(shim: EmulatedTile, grid: tuple[int, ...], kernel, args: tuple[Any, ...]) -> None:
    """Run `kernel(*args)` once per block of `grid`, in order."""
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    shim._grid = grid3
    for bid in itertools.product(*(range(g) for g in grid3)):
        shim._bid = bid
        kernel(*args)
