"""The `cuda.tile` stand-in of the CPU interpreter (`emulator.py`): torch ops in place of the
cuTile API subset this package's kernels use.

Emulated semantics (cuda-tile 1.7.0: the `cuda/tile/_stub.py` docstrings and the `_ir` sources
named below; the kernels' exported TileIR was checked against the same points):
- `load(array, index, shape, order, padding_mode)`: tile `index` of the tile space of
  `array.permute(order)`; out-of-bounds elements read as the `padding_mode` value. The default,
  `PaddingMode.UNDETERMINED`, is "undetermined" in cuTile (`_stub.py` `load`): the emulator reads
  NaN there (a poison value) so a kernel relying on it fails here too. A tile entirely out of
  bounds (undefined in cuTile) or a tile dimension that is not a power of two raises.
  `check_bounds=False` (a const bool; "violating this assumption is undefined behavior", `_stub.py`
  `load`) raises for a tile that is not entirely in bounds, so a wrapper that asks for unchecked
  loads in a launch with a partial tile fails here.
- `store`: out-of-bounds elements are dropped (an unchecked store past its array raises, as an
  unchecked load does); the tile is cast to the array dtype only where
  cuTile's implicit cast allows it (`_ir/ops.py` `tile_store_impl` -> `implicit_cast`: the
  promotion of the two dtypes must be the array dtype, e.g. bf16 -> fp32 yes, fp32 -> bf16 no).
- `astype(x, tfloat32)`: fp32 rounded to 10 mantissa bits (round to nearest even, the default
  `RoundingMode.RN`); `mma(a, b, acc)`: exact products of the (already rounded) operands,
  accumulated exactly and rounded once to fp32 per call (the tensor cores round their fp32
  accumulation more often, in an order the emulator does not know; only a GPU run measures it).
- `truediv(x, y, rounding_mode=RoundingMode.APPROX)` (fp32 `div.approx`, <= 2 ulp): `x * (1 / y)`
  in fp32 (within an ulp of the GPU's `x * rcp.approx(y)`); other modes divide exactly.
- `max` / `maximum` / `minimum`: NaN inputs are ignored (`propagate_nan=False` is the cuTile
  default, `_stub.py` `_math_op_extra_block`), unlike torch's NaN-propagating `amax`/`maximum`.
"""

from __future__ import annotations

import math
import types

import torch

__all__ = ["EmulatedTile", "ConstantAnnotation"]


class ConstantAnnotation:
    """`ct.Constant[int]` in an annotation."""

    def __class_getitem__(cls, item):
        return cls


class _PaddingMode:
    """`ct.PaddingMode` (`cuda/tile/_numeric_semantics.py`)."""

    UNDETERMINED = "undetermined"
    ZERO = "zero"
    NEG_ZERO = "neg_zero"
    NAN = "nan"
    POS_INF = "pos_inf"
    NEG_INF = "neg_inf"


class _RoundingMode:
    """`ct.RoundingMode` (`cuda/tile/_numeric_semantics.py`), the modes the kernels use."""

    RN = "nearest_even"
    FULL = "full"
    APPROX = "approx"


_PAD_VALUE = {
    _PaddingMode.ZERO: 0.0,
    _PaddingMode.NEG_ZERO: -0.0,
    _PaddingMode.NAN: math.nan,
    _PaddingMode.POS_INF: math.inf,
    _PaddingMode.NEG_INF: -math.inf,
}


def _pad_fill(padding_mode, dtype: torch.dtype):
    """The value out-of-bounds elements of a load read as; `UNDETERMINED` (the default) is poison."""
    if padding_mode is None or padding_mode == _PaddingMode.UNDETERMINED:
        if dtype == torch.bool:
            return True
        return math.nan if dtype.is_floating_point else torch.iinfo(dtype).max
    return _PAD_VALUE[padding_mode]


class _TF32:
    """Marker dtype for `ct.tfloat32`."""

    def __repr__(self) -> str:
        return "tfloat32"


def _is_pow2(v: int) -> bool:
    return v >= 1 and (v & (v - 1)) == 0


def _round_tf32(t: torch.Tensor) -> torch.Tensor:
    t = t.to(torch.float32).contiguous()
    bits = t.view(torch.int32).to(torch.int64)
    lsb = (bits >> 13) & 1
    bits = ((bits + 0xFFF + lsb) >> 13) << 13
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    out = bits.to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(t), t, out)  # the bit trick would turn some NaNs into inf


def _scalar_dtype(v) -> torch.dtype:
    """cuTile's dtype of a Python constant (`_ir/typing_support.py` `dtype_of_constant_scalar`)."""
    if isinstance(v, bool):
        return torch.bool
    if isinstance(v, int):
        return torch.int32 if -(2**31) <= v < 2**31 else torch.int64
    return torch.float32


def _nan_ignoring(x: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` with NaN replaced by `fill`, and the NaN mask (None for a non-float `x`)."""
    if not x.is_floating_point():
        return x, None
    nan = torch.isnan(x)
    return torch.where(nan, torch.full_like(x, fill), x), nan


def _perm(order, ndim: int) -> tuple[int, ...]:
    if order == "C":
        return tuple(range(ndim))
    if order == "F":
        return tuple(reversed(range(ndim)))
    return tuple(order)


def _region(view: torch.Tensor, index, shape) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    if len(index) != view.dim() or len(shape) != view.dim():
        raise ValueError(
            f"emulator: index {tuple(index)} / shape {tuple(shape)} do not match an array of rank {view.dim()}"
        )
    src, dst = [], []
    for i, s, size in zip(index, shape, view.shape, strict=True):
        if not _is_pow2(int(s)):
            raise ValueError(f"emulator: tile dimension {s} is not a power of two")
        start = int(i) * int(s)
        stop = min(start + int(s), size)
        if start >= size or int(i) < 0:
            raise ValueError(
                f"emulator: tile {tuple(index)} of shape {tuple(shape)} lies outside array {tuple(view.shape)}"
            )
        src.append(slice(start, stop))
        dst.append(slice(0, stop - start))
    return tuple(src), tuple(dst)


def _check_bounds_flag(check_bounds, what: str) -> None:
    if not isinstance(check_bounds, bool):
        raise ValueError(f"emulator: {what} check_bounds={check_bounds!r}: cuTile takes a const bool")


def _require_inside(what: str, index, shape, dst: tuple[slice, ...], view: torch.Tensor) -> None:
    """Raise unless the tile (`dst`: its part inside the array, `_region`) is whole: an unchecked access
    (`check_bounds=False`) past the array is undefined in cuTile."""
    if any(d.stop < int(s) for d, s in zip(dst, shape, strict=True)):
        raise ValueError(
            f"emulator: unchecked {what} (check_bounds=False) of tile {tuple(int(i) for i in index)} "
            f"of shape {tuple(int(s) for s in shape)} runs past array {tuple(view.shape)}"
        )


class EmulatedTile(types.ModuleType):
    """The stand-in for `cuda.tile`; one instance per emulated launch context."""

    Constant = ConstantAnnotation
    PaddingMode = _PaddingMode
    RoundingMode = _RoundingMode
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
    def load(
        array,
        index,
        shape,
        *,
        order="C",
        padding_mode=_PaddingMode.UNDETERMINED,
        latency=None,
        allow_tma=None,
        check_bounds=True,
        **_,
    ):
        _check_bounds_flag(check_bounds, "load")
        if latency is not None and (
            isinstance(latency, bool) or not isinstance(latency, int) or not 1 <= latency <= 10
        ):
            raise ValueError(f"emulator: load latency={latency!r}: cuTile takes an integer in 1-10 (or None)")
        if not (allow_tma is None or isinstance(allow_tma, bool)):
            raise ValueError(f"emulator: load allow_tma={allow_tma!r}: cuTile takes a bool (or None)")
        view = array.permute(_perm(order, array.dim()))
        src, dst = _region(view, index, shape)
        if not check_bounds:
            _require_inside("load", index, shape, dst, view)
        fill = _pad_fill(padding_mode, array.dtype)
        out = torch.full(tuple(int(s) for s in shape), fill, dtype=array.dtype, device=array.device)
        out[dst] = view[src]
        return out

    @staticmethod
    def store(array, index, tile, *, order="C", check_bounds=True, **_):
        _check_bounds_flag(check_bounds, "store")
        if not isinstance(tile, torch.Tensor):  # a Python scalar: a loosely typed constant
            src_dtype = _scalar_dtype(tile)
            tile = torch.tensor(tile, dtype=src_dtype)
        # cuTile casts the tile implicitly where promote(tile dtype, array dtype) is the array
        # dtype (`implicit_cast` in `_ir/cast_ops.py`); bf16 / fp16 do not promote to each other.
        ok = tile.dtype == array.dtype or (
            torch.promote_types(tile.dtype, array.dtype) == array.dtype
            and {tile.dtype, array.dtype} != {torch.bfloat16, torch.float16}
        )
        if not ok:
            raise TypeError(f"emulator: storing a {tile.dtype} tile into a {array.dtype} array")
        tile = tile.to(array.dtype)
        if tile.dim() == 0:  # a 0-d tile is stored as a tile of ones in every dimension
            tile = tile.reshape((1,) * array.dim())
        view = array.permute(_perm(order, array.dim()))
        src, dst = _region(view, index, tile.shape)
        if not check_bounds:
            _require_inside("store", index, tile.shape, dst, view)
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
    def truediv(x, y, *, rounding_mode=None, flush_to_zero=False):
        if rounding_mode == _RoundingMode.APPROX:
            return x * torch.reciprocal(torch.as_tensor(y))
        return x / y

    @staticmethod
    def log(x):
        return torch.log(torch.as_tensor(x))

    @staticmethod
    def sqrt(x):
        return torch.sqrt(torch.as_tensor(x))

    # `maximum` / `minimum`: NaN-ignoring (cuTile's default `propagate_nan=False`), i.e. fmax/fmin.
    @staticmethod
    def _binary_minmax(x, y, fn, py):
        if isinstance(x, int | float) and isinstance(y, int | float):
            return py(x, y)
        if not isinstance(x, torch.Tensor):
            x, y = y, x
        if not isinstance(y, torch.Tensor):  # a loosely typed constant takes the tile's dtype
            y = torch.tensor(y, dtype=torch.result_type(x, y))
            x = x.to(y.dtype)
        return fn(x, y)

    @staticmethod
    def maximum(x, y):
        return EmulatedTile._binary_minmax(x, y, torch.fmax, max)

    @staticmethod
    def minimum(x, y):
        return EmulatedTile._binary_minmax(x, y, torch.fmin, min)

    @staticmethod
    def where(cond, x, y):
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            # Two Python constants: cuTile's default types (fp32 / int32), not torch's default dtype.
            dtype = torch.promote_types(_scalar_dtype(x), _scalar_dtype(y))
            x = torch.tensor(x, dtype=dtype)
        return torch.where(cond, x, y)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    # -- reductions ---------------------------------------------------------------------------
    @staticmethod
    def sum(x, axis=None, *, keepdims=False):
        dims = tuple(range(x.dim())) if axis is None else axis
        return x.sum(dim=dims, keepdim=keepdims)

    @staticmethod
    def max(x, axis=None, *, keepdims=False):
        # NaN-ignoring (cuTile's default `propagate_nan=False`); all-NaN reduces to NaN.
        dims = tuple(range(x.dim())) if axis is None else axis
        filled, nan = _nan_ignoring(x, -math.inf)
        out = filled.amax(dim=dims, keepdim=keepdims)
        if nan is not None:
            out = torch.where(nan.all(dim=dims, keepdim=keepdims), math.nan, out)
        return out

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
        tiles = tuple(tiles)
        # `_ir/ops.py` `cat`: at most two tiles, same dtype and shape off the axis.
        if len(tiles) > 2 or len({t.dtype for t in tiles}) > 1:
            raise ValueError("emulator: cat takes at most two tiles of one dtype")
        out = torch.cat(tiles, dim=axis)
        if not all(_is_pow2(d) for d in out.shape):
            raise ValueError(f"emulator: cat result shape {tuple(out.shape)} is not a power of two")
        return out

    @staticmethod
    def extract(x, index, shape):
        sl = tuple(slice(int(i) * int(s), (int(i) + 1) * int(s)) for i, s in zip(index, shape, strict=True))
        out = x[sl]
        if tuple(out.shape) != tuple(shape):
            raise ValueError(
                f"emulator: extract {tuple(index)} of shape {tuple(shape)} out of tile {tuple(x.shape)}"
            )
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
