"""cuTile kernels run on the CPU kernel interpreter, forward and backward, against the reference ops.

No GPU and no `cuda.tile` needed: `EmulatedRuntime` executes the kernel source block by block
with torch ops (see `tools/cutile/emulator.py`). This checks the kernels' algorithm
and indexing on every machine; the GPU parity tests (`test_gpu_parity.py`) check the compiled
kernels where a GPU is present.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mhc_core import ops as ref
from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.ops import make_ops
from mhc_core.variants import Variant
from suites.unit.kernels_cutile.cutile_cases import (
    DTYPE_NAMES,
    MAPPING_COSINE,
    MAPPING_INPUT_NAMES,
    POST_BDA_INPUT_NAMES,
    SINKHORN_FORMS,
    VARIANT_NAMES,
    aggregate_inputs,
    compare,
    grad_errors_vs_fp64,
    mapping_inputs,
    mapping_oracle,
    post_bda_inputs,
    sinkhorn_inputs,
)
from tools.cutile import emulated_tile
from tools.cutile.emulator import EmulatedRuntime

VARIANTS = [pytest.param(v, id=VARIANT_NAMES[v]) for v in Variant]
DTYPES = [pytest.param(d, id=DTYPE_NAMES[d]) for d in (torch.float32, torch.bfloat16)]


# Kernel outputs start as NaN: an unwritten tile fails (conftest.poisoned_empty).
pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.fixture(scope="module")
def emu():
    return make_ops(EmulatedRuntime(num_sms=4))


SINKHORN_TILES = [pytest.param(None, id="default")] + [
    pytest.param(tiling.SinkhornTiles(32, **kw), id=name) for name, kw in SINKHORN_FORMS.items()
]


@pytest.mark.parametrize("tiles", SINKHORN_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_sinkhorn(emu, n, variant, dtype, tiles):
    """Sinkhorn fwd + bwd matches the reference, 5 iterations, 37 matrices (2 blocks of 32 for the
    other formulations: batch-last and per-element, stored or recomputed backward)."""
    with tiling.overridden(**({} if tiles is None else {"sinkhorn": tiles})):
        compare(
            f"sinkhorn {tiles} n{n} {variant} {dtype}",
            lambda z: emu.sinkhorn(z, 5, None, variant),
            lambda z: ref.sinkhorn(z, 5, None, variant),
            sinkhorn_inputs(n, dtype, "cpu"),
            dtype,
            input_names=("logits",),
        )


@pytest.mark.parametrize("tiles", [None, tiling.SinkhornTiles(64, per_element=True),
                                   tiling.SinkhornTiles(64, per_element=True, checkpoint=3)],
                         ids=["default", "per_element", "per_element-checkpoint3"])
@pytest.mark.parametrize("iterations", [1, 20])
@pytest.mark.parametrize("variant", VARIANTS)
def test_sinkhorn_iterations(emu, variant, iterations, tiles):
    """Iteration counts at the edges (1: no pair loop for megatron_dev; 20: the default), 3 blocks."""
    with tiling.overridden(**({} if tiles is None else {"sinkhorn": tiles})):
        compare(
            f"sinkhorn it{iterations} {variant}",
            lambda z: emu.sinkhorn(z, iterations, None, variant),
            lambda z: ref.sinkhorn(z, iterations, None, variant),
            sinkhorn_inputs(4, torch.float32, "cpu", batch=150),
            torch.float32,
            input_names=("logits",),
        )


AGG_DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-coef_fp32"),
]
SHAPES = [pytest.param(13, 48, id="T13-C48"), pytest.param(21, 300, id="T21-C300")]


@pytest.mark.parametrize(("t", "c"), SHAPES)
@pytest.mark.parametrize(("x_dtype", "h_dtype"), AGG_DTYPES)
@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_h_aggregate(emu, n, x_dtype, h_dtype, t, c):
    """h_aggregate fwd + bwd matches the reference (partial token and channel tiles)."""
    compare(
        f"h_aggregate n{n} T{t} C{c}",
        emu.h_aggregate,
        ref.h_aggregate,
        aggregate_inputs(t, n, c, x_dtype, h_dtype, "cpu"),
        x_dtype,
        input_names=("x", "h_pre"),
    )


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("t", "c"), SHAPES)
@pytest.mark.parametrize(("x_dtype", "h_dtype"), AGG_DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_h_post_bda(emu, n, variant, x_dtype, h_dtype, t, c, with_bias):
    """h_post_bda fwd + bwd (both mix orientations, with and without bias) matches the reference."""
    compare(
        f"h_post_bda n{n} {variant} T{t} C{c} bias={with_bias}",
        lambda *a: emu.h_post_bda(*a, 0.0, False, variant),
        lambda *a: ref.h_post_bda(*a, 0.0, False, variant),
        post_bda_inputs(t, n, c, x_dtype, h_dtype, with_bias, "cpu"),
        x_dtype,
        input_names=POST_BDA_INPUT_NAMES,
        cosine_inputs=("bias",),
    )


def test_h_post_bda_n8(emu):
    """n = 8 through the transposed (megatron_dev) path with bias."""
    variant = Variant.MEGATRON_DEV
    compare(
        "h_post_bda n8 dev",
        lambda *a: emu.h_post_bda(*a, 0.0, False, variant),
        lambda *a: ref.h_post_bda(*a, 0.0, False, variant),
        post_bda_inputs(21, 8, 300, torch.float32, torch.float32, True, "cpu"),
        torch.float32,
        input_names=POST_BDA_INPUT_NAMES,
    )


# h_post_bda: both mix orientations, with and without bias, n = 2 / 4 / 8; h_aggregate: n only.
_POST_BDA_CASES = [(4, Variant.MEGATRON_DEV, True), (4, Variant.MEGATRON_MAIN, False), (2, Variant.PAPER, True),
                   (8, Variant.MEGATRON_DEV, False)]
STREAM_FORM_CASES = [
    pytest.param("h_aggregate", mode, n, None, False, id=f"h_aggregate-{mode}-n{n}") for mode in (0, 1) for n in (2, 4, 8)
] + [
    pytest.param("h_post_bda", mode, n, v, b, id=f"h_post_bda-{mode}-n{n}-{v.value}{'-bias' if b else ''}")
    for mode in (0, 1, 2) for n, v, b in _POST_BDA_CASES
]


@pytest.mark.parametrize("loop_c", [False, True], ids=["grid_c", "loop_c"])
@pytest.mark.parametrize(("op", "mode", "n", "variant", "with_bias"), STREAM_FORM_CASES)
def test_stream_formulations(emu, op, mode, n, variant, with_bias, loop_c):
    """Each stream-kernel formulation (`StreamTiles.per_stream` forward and h_post_bda backward; the
    forward's C loop, `loop_c`) matches the reference."""
    t, c = 21, 300
    tiles = tiling.StreamTiles(tile_t=8, tile_c=128, per_stream=mode, loop_c=loop_c)
    if op == "h_aggregate":
        kernel, oracle, inputs, names = emu.h_aggregate, ref.h_aggregate, aggregate_inputs(
            t, n, c, torch.bfloat16, torch.float32, "cpu"), ("x", "h_pre")
    else:
        kernel = lambda *a: emu.h_post_bda(*a, 0.0, False, variant)  # noqa: E731
        oracle = lambda *a: ref.h_post_bda(*a, 0.0, False, variant)  # noqa: E731
        inputs = post_bda_inputs(t, n, c, torch.bfloat16, torch.float32, with_bias, "cpu")
        names = POST_BDA_INPUT_NAMES
    overrides = {f"{op}_fwd": tiles}
    if op == "h_post_bda":
        overrides["h_post_bda_bwd"] = tiling.StreamTiles(tile_t=8, tile_c=128, per_stream=mode)  # loop_c: bwd always
    with tiling.overridden(**overrides):
        compare(f"{op} {tiles} n{n} {variant}", kernel, oracle, inputs, torch.bfloat16, input_names=names)


def _spied_stream_ops(monkeypatch, fwd, bwd, t, c, unchecked_loads=True):
    """Run h_aggregate and h_post_bda (megatron_dev, bias) forward and backward at `t` x `c`, n = 4, bf16,
    under the stream tiles `fwd` / `bwd` on the interpreter (a runtime with `unchecked_loads`), each against
    the reference; return each stream kernel's `LOADS` and the keyword arguments of its streaming loads and
    stores (activations and gradients `[T, n, C]`, `[T, C]`; not the coefficients or the fp32 bias partials)."""
    seen, loads, stores = {}, [], []
    real_load, real_store = emulated_tile.EmulatedTile.load, emulated_tile.EmulatedTile.store

    def load(array, index, shape, **kw):
        if array.dim() in (2, 3) and array.shape[-1] > 8:
            loads.append(kw)
        return real_load(array, index, shape, **kw)

    def store(array, index, tile, **kw):
        if array.shape[-1] > 8 and (array.dim() == 3 or array.dtype == torch.bfloat16):
            stores.append(kw)
        return real_store(array, index, tile, **kw)

    monkeypatch.setattr(emulated_tile.EmulatedTile, "load", staticmethod(load))
    monkeypatch.setattr(emulated_tile.EmulatedTile, "store", staticmethod(store))

    class Spy(EmulatedRuntime):
        def launch(self, grid, kernel_name, args):
            seen[kernel_name] = args[-1]
            super().launch(grid, kernel_name, args)

    runtime = Spy(num_sms=4)
    runtime.unchecked_loads = unchecked_loads
    spy, variant = make_ops(runtime), Variant.MEGATRON_DEV
    with tiling.overridden(h_aggregate_fwd=fwd, h_post_bda_fwd=fwd, h_aggregate_bwd=bwd, h_post_bda_bwd=bwd):
        compare(f"h_aggregate {fwd} {bwd} T{t} C{c}", spy.h_aggregate, ref.h_aggregate,
                aggregate_inputs(t, 4, c, torch.bfloat16, torch.float32, "cpu"), torch.bfloat16, input_names=("x", "h_pre"))
        compare(f"h_post_bda {fwd} {bwd} T{t} C{c}", lambda *a: spy.h_post_bda(*a, 0.0, False, variant),
                lambda *a: ref.h_post_bda(*a, 0.0, False, variant),
                post_bda_inputs(t, 4, c, torch.bfloat16, torch.float32, True, "cpu"), torch.bfloat16,
                input_names=POST_BDA_INPUT_NAMES)
    return seen, loads, stores


@pytest.mark.parametrize(("latency", "tma"), [(10, True), (9, False)], ids=["latency10", "latency9-no_tma"])
@pytest.mark.parametrize(("mode", "mma"), [(0, False), (1, False), (2, False), (0, True)],
                         ids=["whole", "per_stream", "tuple", "mma"])
def test_stream_load_hints(mode, mma, latency, tma, monkeypatch):
    """`StreamTiles.latency` and `.tma` reach all four stream kernels as their `LOADS` constant
    (`tiling.load_code`) and every streaming load as `ct.load(latency=..., allow_tma=...)` (the
    interpreter's `ct.load` refuses a hint outside 1-10), and change no result."""
    fwd = tiling.StreamTiles(8, 128, per_stream=mode, loop_c=True, mma=mma, latency=latency, tma=tma)
    bwd = tiling.StreamTiles(8, 128, per_stream=mode, mma=mma, latency=latency, tma=tma)
    seen, loads, _ = _spied_stream_ops(monkeypatch, fwd, bwd, 21, 300)
    code = latency + (0 if tma else tiling.NO_TMA)
    assert seen == dict.fromkeys(("h_aggregate_fwd_kernel", "h_aggregate_bwd_kernel", "h_post_bda_fwd_kernel",
                                  "h_post_bda_bwd_kernel"), code)
    assert {(kw.get("latency"), kw.get("allow_tma")) for kw in loads} == {(latency, None if tma else False)}
    with pytest.raises(ValueError, match="latency must be an integer in 0-10"):
        with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(8, 64, latency=11)):
            pass
    with pytest.raises(ValueError, match="tma must be True"):
        with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(8, 64, tma=0)):
            pass
    with pytest.raises(ValueError, match="unchecked must be True"):
        with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(8, 64, unchecked=1)):
            pass


@pytest.mark.parametrize("checks_ok", [True, False], ids=["tileiras13.4", "tileiras13.3"])
@pytest.mark.parametrize(("t", "c"), [(32, 512), (21, 512), (32, 300)], ids=["whole", "partial_T", "partial_C"])
@pytest.mark.parametrize(("mode", "mma"), [(2, False), (0, True)], ids=["tuple", "mma"])
def test_unchecked_loads_only_in_launches_of_whole_tiles(mode, mma, t, c, checks_ok, monkeypatch):
    """`StreamTiles.unchecked` reaches the four stream kernels as `tiling.UNCHECKED` in `LOADS`, and their
    streaming loads and stores as `check_bounds=False`, only in a launch of whole tiles on a runtime whose
    compiler takes them; a partial tile keeps the checked accesses (the interpreter's unchecked `ct.load` /
    `ct.store` raise past their array), and no result changes."""
    fwd = tiling.StreamTiles(8, 128, per_stream=mode, loop_c=True, mma=mma, tma=False, unchecked=True)
    bwd = tiling.StreamTiles(8, 128, per_stream=mode, mma=mma, unchecked=True)
    seen, loads, stores = _spied_stream_ops(monkeypatch, fwd, bwd, t, c, unchecked_loads=checks_ok)
    unchecked = checks_ok and t % 8 == 0 and c % 128 == 0
    bit = tiling.UNCHECKED if unchecked else 0
    assert seen == {"h_aggregate_fwd_kernel": tiling.NO_TMA + bit, "h_post_bda_fwd_kernel": tiling.NO_TMA + bit,
                    "h_aggregate_bwd_kernel": bit, "h_post_bda_bwd_kernel": bit}
    assert {kw.get("check_bounds", True) for kw in loads} == {not unchecked}
    assert {kw.get("check_bounds", True) for kw in stores} == {not unchecked}


def test_unchecked_access_past_its_array_raises():
    """The interpreter's `ct.load` / `ct.store` with `check_bounds=False` raise, naming the tile and the
    array, for a tile that runs past the array (undefined behaviour on the GPU), and access a whole tile
    as the checked ones do."""
    shim = emulated_tile.EmulatedTile()
    a = torch.arange(40.0).reshape(5, 8)
    assert torch.equal(shim.load(a, (1, 0), (2, 8), check_bounds=False), a[2:4])
    with pytest.raises(ValueError, match=r"unchecked load .* tile \(2, 0\) of shape \(2, 8\) runs past array \(5, 8\)"):
        shim.load(a, (2, 0), (2, 8), check_bounds=False)
    shim.store(a, (1, 0), torch.zeros(2, 8), check_bounds=False)
    assert a[2:4].eq(0).all() and a[:2].ne(0).any()
    with pytest.raises(ValueError, match=r"unchecked store .* tile \(2, 0\) of shape \(2, 8\) runs past array \(5, 8\)"):
        shim.store(a, (2, 0), torch.ones(2, 8), check_bounds=False)
    assert a[4].ne(1).any(), "nothing is written on the way to the error"
    for access in (lambda: shim.load(a, (0, 0), (2, 8), check_bounds=1),
                   lambda: shim.store(a, (0, 0), torch.ones(2, 8), check_bounds=1)):
        with pytest.raises(ValueError, match="check_bounds=1"):
            access()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "variant", "with_bias"),
                         [pytest.param(n, v, b, id=f"n{n}-{v.value}{'-bias' if b else ''}") for n, v, b in _POST_BDA_CASES])
def test_post_bda_bwd_mma(emu, n, variant, with_bias, dtype):
    """The h_post_bda backward with its channel sums as tensor-core products (`StreamTiles.mma`:
    bf16 products, `y + bias` split hi + lo; 3xTF32 in fp32) matches the reference; 3 token tiles,
    the last partial, and a partial C tile."""
    t, c = 21, 300
    tile_t = max(2, 16 // n)  # TILE_T * n = 16
    inputs = post_bda_inputs(t, n, c, dtype, torch.float32, with_bias, "cpu")
    with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(tile_t=tile_t, tile_c=128, mma=True)):
        compare(f"h_post_bda mma n{n} {variant} {dtype}",
                lambda *a: emu.h_post_bda(*a, 0.0, False, variant),
                lambda *a: ref.h_post_bda(*a, 0.0, False, variant),
                inputs, dtype, input_names=POST_BDA_INPUT_NAMES)


@pytest.mark.parametrize(("x_dtype", "h_dtype"), AGG_DTYPES)
@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_aggregate_bwd_mma(emu, n, x_dtype, h_dtype):
    """The h_aggregate backward with its channel sum as a tensor-core product (`StreamTiles.mma`)
    matches the reference, and its grad_h_pre stays within 1e-5 (of the largest entry) of fp64: 3
    token tiles, the last partial, and a partial C tile."""
    inputs = aggregate_inputs(21, n, 300, x_dtype, h_dtype, "cpu")
    grad = torch.randn(21, 300, generator=torch.Generator().manual_seed(6)).to(x_dtype)
    with tiling.overridden(h_aggregate_bwd=tiling.StreamTiles(tile_t=8, tile_c=128, mma=True)):
        compare(f"h_aggregate mma bwd n{n}", emu.h_aggregate, ref.h_aggregate, inputs, x_dtype,
                input_names=("x", "h_pre"))
        (err,) = grad_errors_vs_fp64(emu.h_aggregate, ref.h_aggregate, inputs, grad, wrt=(1,))
    bound = 1e-5 if h_dtype == torch.float32 else 1e-2  # bf16 grad_h: its own rounding
    assert err <= bound, f"grad_h_pre: max error {err:.3e} of the largest entry > {bound} (n={n})"


@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_post_bda_bwd_mma_coefficient_precision(emu, n):
    """With bf16 activations and a bias, the tensor-core channel sums keep fp32 accuracy: grad_h_res
    and grad_h_post within 1e-5 (of their largest entry) of fp64 (`y + bias` is not exact in bf16;
    rounding it for a plain bf16 product costs ~2e-3 here)."""
    inputs = post_bda_inputs(21, n, 300, torch.bfloat16, torch.float32, True, "cpu")
    grad = torch.randn(21, n, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(tile_t=16 // n, tile_c=128, mma=True)):
        errs = grad_errors_vs_fp64(lambda *a: emu.h_post_bda(*a, 0.0, False, Variant.MEGATRON_MAIN),
                                   lambda *a: ref.h_post_bda(*a, 0.0, False, Variant.MEGATRON_MAIN),
                                   inputs, grad, wrt=(0, 2))
    for name, err in zip(("grad_h_res", "grad_h_post"), errs, strict=True):
        assert err <= 1e-5, f"{name}: max error {err:.3e} of the largest entry > 1e-5 (n={n})"


_FWD_MMA_CASES = [pytest.param(op, n, v, b, id=f"{op}-n{n}-{v.value}{'-bias' if b else ''}")
                  for op in ("h_aggregate", "h_post_bda") for n, v, b in _POST_BDA_CASES]


@pytest.mark.parametrize(("x_dtype", "coef"), AGG_DTYPES)
@pytest.mark.parametrize(("op", "n", "variant", "with_bias"), _FWD_MMA_CASES)
def test_forward_mma(emu, op, n, variant, with_bias, x_dtype, coef):
    """The stream forwards with the sum over streams on the tensor cores (`StreamTiles.mma`: bf16 products,
    fp32 coefficients as bf16 hi + lo, 3xTF32 in fp32) match the reference, fwd + bwd; 3 token tiles, the
    last partial, and a partial C tile, per C tile and C-looping."""
    t, c = 21, 300
    if op == "h_aggregate":
        tiles = tiling.StreamTiles(tile_t=8, tile_c=128, mma=True)  # the MMA's N edge is TILE_T
        kernel, oracle, names = emu.h_aggregate, ref.h_aggregate, ("x", "h_pre")
        inputs = aggregate_inputs(t, n, c, x_dtype, coef, "cpu")
    else:
        tiles = tiling.StreamTiles(tile_t=max(2, 16 // n), tile_c=128, mma=True)
        kernel = lambda *a: emu.h_post_bda(*a, 0.0, False, variant)  # noqa: E731
        oracle = lambda *a: ref.h_post_bda(*a, 0.0, False, variant)  # noqa: E731
        inputs, names = post_bda_inputs(t, n, c, x_dtype, coef, with_bias, "cpu"), POST_BDA_INPUT_NAMES
    for loop_c in (False, True):
        with tiling.overridden(**{f"{op}_fwd": dataclasses.replace(tiles, loop_c=loop_c)}):
            compare(f"{op} mma fwd n{n} {variant} loop_c={loop_c}", kernel, oracle, inputs, x_dtype, input_names=names)


@pytest.mark.parametrize("op", ["h_aggregate", "h_post_bda"])
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_forward_mma_keeps_fp32_coefficients(emu, op, n):
    """With bf16 activations and fp32 coefficients (`megatron_dev`), the tensor-core forwards give the
    reference's bf16 output bit for bit in >= 99 % of the elements (the coefficients go in as bf16
    hi + lo; rounding them to bf16 once leaves only 62-77 % equal)."""
    variant = Variant.MEGATRON_DEV
    with torch.no_grad():
        if op == "h_aggregate":
            inputs = aggregate_inputs(64, n, 512, torch.bfloat16, torch.float32, "cpu")
            with tiling.overridden(h_aggregate_fwd=tiling.StreamTiles(8, 128, mma=True)):
                out = emu.h_aggregate(*inputs)
            want = ref.h_aggregate(*inputs)
        else:
            inputs = post_bda_inputs(64, n, 512, torch.bfloat16, torch.float32, True, "cpu")
            with tiling.overridden(h_post_bda_fwd=tiling.StreamTiles(max(2, 16 // n), 128, mma=True)):
                out = emu.h_post_bda(*inputs, 0.0, False, variant)
            want = ref.h_post_bda(*inputs, 0.0, False, variant)
    equal = float((out == want).float().mean())
    assert equal >= 0.99, f"{op} n={n}: {equal:.2%} of {out.numel()} outputs equal the reference's bits (< 99 %)"


def test_mma_needs_tensor_core_sized_tiles():
    """`StreamTiles.mma` takes the tensor-core path only where the MMA reduces over >= 16 and has edges
    of >= 8 (small tiles: tiny C, few tokens, keep the CUDA cores); the precision follows the dtypes."""
    from mhc_core.kernels.cutile.ops_common import MMA_2XBF16, MMA_3XTF32, MMA_BF16
    from mhc_core.kernels.cutile.ops_streams import _mma_code

    bf16, fp32 = torch.bfloat16, torch.float32
    assert _mma_code(True, 64, (32,), bf16, True) == MMA_BF16
    assert _mma_code(True, 64, (32,), bf16, False) == MMA_2XBF16  # fp32 coefficients: hi + lo
    assert _mma_code(True, 64, (32,), fp32, True) == MMA_3XTF32
    assert _mma_code(False, 64, (32,), bf16, True) == -1
    assert _mma_code(True, 8, (32,), bf16, True) == -1  # K = 8
    assert _mma_code(True, 32, (256, 4), bf16, True) == -1  # an edge of 4


def test_tile_override_is_scoped_and_checked():
    """`tiling.overridden` applies inside its block only and refuses tiles that are not powers of two."""
    default = tiling.aggregate_tiles(4, 4096, "fwd")
    with tiling.overridden(h_aggregate_fwd=tiling.StreamTiles(tile_t=16, tile_c=256),
                           sinkhorn=tiling.SinkhornTiles(8, True)):
        assert tiling.aggregate_tiles(4, 4096, "fwd") == tiling.StreamTiles(tile_t=16, tile_c=256)
        assert tiling.sinkhorn_tile(4) == tiling.SinkhornTiles(8, True)
    assert tiling.aggregate_tiles(4, 4096, "fwd") == default
    with pytest.raises(ValueError, match="powers of two"):
        with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(tile_t=3, tile_c=128)):
            pass
    with pytest.raises(ValueError, match="unknown key"):
        with tiling.overridden(h_aggregate=8):
            pass


@pytest.mark.parametrize(("tile", "match"), [
    (tiling.SinkhornTiles(64, checkpoint=2), "per-element kernels only"),
    (tiling.SinkhornTiles(64, per_element=True, checkpoint=-1), "integer >= 0"),
    (tiling.SinkhornTiles(64, per_element=True, checkpoint=True), "integer >= 0"),
    (tiling.SinkhornTiles(64, per_element=True, fwd_checkpoints=True), "needs checkpoint >= 1"),
    (tiling.SinkhornTiles(64, per_element=True, checkpoint=2, fwd_checkpoints=1), "fwd_checkpoints is a bool"),
], ids=["not-per-element", "negative", "bool", "fwd-without-checkpoint", "fwd-not-bool"])
def test_sinkhorn_checkpoint_is_checked(tile, match):
    """A checkpointed Sinkhorn backward (`checkpoint`) is refused outside the per-element kernels or below 0,
    and forward checkpoints (`fwd_checkpoints`) without it."""
    with pytest.raises(ValueError, match=match):
        with tiling.overridden(sinkhorn=tile):
            pass


MAPPING_SHAPES = [
    pytest.param(20, 300, id="T20-C300"),  # 2 K splits in the forward
    pytest.param(520, 48, id="T520-C48"),  # 2 token splits in the backward
]


@pytest.mark.parametrize("bwd", [None, tiling.MappingTiles(tile_m=32, tile_k=128, split_dx=True)],
                         ids=["fused_dx", "split_dx"])
@pytest.mark.parametrize(("t", "c"), MAPPING_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_mapping(emu, n, variant, dtype, t, c, bwd):
    """mapping fwd + bwd (split-K forward, split-token backward; grad_x in the K loop or its own kernel) matches the reference."""
    oracle = None
    if variant == Variant.MEGATRON_MAIN and dtype == torch.bfloat16:
        oracle = mapping_oracle(n, variant)
    with tiling.overridden(**({} if bwd is None else {"mapping_bwd": bwd})):
        compare(
            f"mapping n{n} {variant} {dtype} T{t} C{c} {bwd}",
            lambda *a: emu.mapping(*a, n, variant),
            lambda *a: ref.mapping(*a, n, variant),
            mapping_inputs(t, n, c, dtype, "cpu"),
            dtype,
            input_names=MAPPING_INPUT_NAMES,
            cosine_inputs=MAPPING_COSINE,
            oracle_fn=oracle,
        )


def test_mapping_n8(emu):
    """n = 8 (N = 80: pre/post tile 16, res tile 64)."""
    compare(
        "mapping n8",
        lambda *a: emu.mapping(*a, 8, Variant.MEGATRON_DEV),
        lambda *a: ref.mapping(*a, 8, Variant.MEGATRON_DEV),
        mapping_inputs(20, 8, 300, torch.float32, "cpu"),
        torch.float32,
        input_names=MAPPING_INPUT_NAMES,
    )
