"""The CPU emulator's `cuda.tile` stand-in against cuTile 1.7's documented semantics.

The expected values are the examples of the `cuda/tile/_stub.py` docstrings (load / store / order,
extract, cat, permute, transpose, reshape) and the rules the emulator docstring cites (padding,
implicit cast on store, NaN-ignoring max, fp32 / int32 scalar arguments, grid limit). No GPU and
no `cuda.tile` needed.
"""

from __future__ import annotations

import math

import pytest
import torch

from tools.cutile.emulator import EmulatedTile, emulate_launch

ct = EmulatedTile()


def test_load_tile_space_and_padding():
    """load indexes in tile space; ZERO padding pads with 0, the default pads with NaN; a tile wholly
    outside the array is an error."""
    x = torch.arange(10)
    assert ct.load(x, (1,), (4,)).tolist() == [4, 5, 6, 7]
    assert ct.load(x, (2,), (4,), padding_mode=ct.PaddingMode.ZERO).tolist() == [8, 9, 0, 0]
    # Undetermined padding (the default) is poison in the emulator, never silently zero.
    xf = torch.arange(10, dtype=torch.float32)
    assert torch.isnan(ct.load(xf, (2,), (4,))[2:]).all()
    with pytest.raises(ValueError, match=r"tile \(3,\) of shape \(4,\) lies outside array \(10,\)"):
        ct.load(xf, (3,), (4,))  # entirely out of bounds: undefined in cuTile


def test_load_order():
    """`order` permutes the loaded tile's axes (column-major and 3-d); num_tiles rounds up."""
    x = torch.arange(16).reshape(4, 4)
    assert [ct.load(x, (i, 0), (1, 4), order="F").tolist() for i in range(2)] == [
        [[0, 4, 8, 12]],
        [[1, 5, 9, 13]],
    ]
    x3 = torch.arange(8).reshape(2, 2, 2)
    assert ct.load(x3, (1, 0, 0), (1, 2, 2), order=(0, 2, 1)).tolist() == [[[4, 6], [5, 7]]]
    assert ct.num_tiles(torch.empty(42, 64), 0, (4, 8)) == 11


def test_store_bounds_and_casts():
    """store clips to the array, takes scalars, widens implicitly and refuses a narrowing store."""
    x = torch.zeros(6, dtype=torch.int32)
    ct.store(x, (0,), torch.ones(4, dtype=torch.int32))
    ct.store(x, (1,), 2 * torch.ones(4, dtype=torch.int32))
    assert x.tolist() == [1, 1, 1, 1, 2, 2]
    y = torch.zeros(2, 2, dtype=torch.int32)
    for i, (a, b) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        ct.store(y, (a, b), tile=i)
    assert y.tolist() == [[0, 1], [2, 3]]
    f = torch.zeros(4, dtype=torch.float32)
    ct.store(f, (0,), torch.full((4,), 1.5, dtype=torch.bfloat16))  # widening: implicit
    assert f.tolist() == [1.5] * 4
    with pytest.raises(TypeError, match="storing a torch.float32 tile into a torch.bfloat16 array"):
        ct.store(torch.zeros(4, dtype=torch.bfloat16), (0,), torch.ones(4))  # narrowing: astype needed


def test_tile_shape_ops():
    """extract, cat, permute, transpose and sum (over all, some, or with keepdims) give torch's values."""
    t = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    assert ct.extract(t, (0, 1), (2, 2)).tolist() == [[2, 3], [6, 7]]
    a, b = torch.full((2, 2), 3), torch.full((2, 2), 7)
    assert ct.cat((a, b), 1).tolist() == [[3, 3, 7, 7], [3, 3, 7, 7]]
    x = torch.arange(8).reshape(2, 2, 2)
    assert ct.permute(x, (2, 0, 1)).tolist() == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    assert ct.transpose(torch.arange(8).reshape(2, 4)).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ct.sum(x, None).item() == 28 and ct.sum(x, (1, 2)).tolist() == [6, 22]
    assert tuple(ct.sum(x, None, keepdims=True).shape) == (1, 1, 1)


def test_nan_ignoring_max_and_scalar_types():
    """max and maximum ignore NaN (as on the GPU); where's scalars are fp32; tf32 rounds to nearest even."""
    v = torch.tensor([[1.0, math.nan], [math.nan, math.nan]])
    out = ct.max(v, axis=1)
    assert out[0].item() == 1.0 and math.isnan(out[1].item())
    assert ct.maximum(torch.tensor([math.nan, 0.5]), 1.0).tolist() == [1.0, 1.0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        w = ct.where(torch.tensor([True, False]), 1.0, 0.0)
    finally:
        torch.set_default_dtype(default)
    assert w.dtype == torch.float32  # cuTile's default float type, whatever torch's default is
    tf32 = ct.astype(torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, math.nan]), ct.tfloat32)
    assert tf32[:2].tolist() == [1.0, 1.0 + 2.0**-9] and math.isnan(tf32[2].item())  # RNE, NaN kept


def test_launch_scalars_and_grid():
    """Scalar arguments arrive as fp32 / int32 values, an int beyond int32 and a grid beyond 2^24 - 1 are errors."""
    seen = []

    def kernel(a, eps: float, k: int, C: int):  # noqa: N803 - kernel-style name
        seen.append((eps, k, C))

    emulate_launch(ct, (1,), kernel, (None, 0.1, 3, 5))
    assert seen == [(float(torch.tensor(0.1, dtype=torch.float32)), 3, 5)]
    with pytest.raises(OverflowError, match="2147483648 does not fit in int32"):
        emulate_launch(ct, (1,), kernel, (None, 0.1, 2**31, 5))
    with pytest.raises(ValueError, match=r"grid \(16777216,\)"):
        emulate_launch(ct, (2**24,), kernel, (None, 0.1, 3, 5))


def test_truediv_rounding_modes():
    """`truediv` divides exactly by default; `RoundingMode.APPROX` multiplies by the fp32 reciprocal (<= 2 ulp)."""
    x = torch.tensor([1.0, 3.0, 10.0, 7.0])
    y = torch.tensor([3.0, 7.0, 3.0, 1e-3])
    assert torch.equal(ct.truediv(x, y), x / y)
    approx = ct.truediv(x, y, rounding_mode=ct.RoundingMode.APPROX)
    assert torch.equal(approx, x * (1.0 / y))
    ulp = torch.finfo(torch.float32).eps * (x / y).abs()
    assert ((approx - x / y).abs() <= 2 * ulp).all()
    assert not torch.equal(approx, x / y)  # the two modes differ somewhere on these inputs
