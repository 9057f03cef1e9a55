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
from mhc_core.kernels.cutile import CuTileBackend, tiling
from mhc_core.kernels.cutile.mapping import pre_fuses
from mhc_core.kernels.dispatch import bound_ops
from mhc_core.variants import Variant
from suites.unit.kernels_cutile.cutile_cases import (
    DTYPE_NAMES,
    MAPPING_COSINE,
    MAPPING_INPUT_NAMES,
    POST_BDA_INPUT_NAMES,
    VARIANT_NAMES,
    aggregate_inputs,
    compare,
    mapping_inputs,
    mapping_oracle,
    post_bda_inputs,
    pre_oracle,
    sinkhorn_inputs,
)
from tools.cutile import emulated_tile
from tools.cutile.emulator import EmulatedRuntime
from tools.cutile.gpu_cases import MAPPING_BWD_TILES, SINKHORN_FORMS

VARIANTS = [pytest.param(v, id=VARIANT_NAMES[v]) for v in Variant]
DTYPES = [pytest.param(d, id=DTYPE_NAMES[d]) for d in (torch.float32, torch.bfloat16)]


# Kernel outputs start as NaN: an unwritten tile fails (conftest.poisoned_empty).
pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.fixture(scope="module")
def emu():
    return bound_ops(CuTileBackend(EmulatedRuntime(num_sms=4)))


SINKHORN_TILES = [pytest.param(None, id="default")] + [
    pytest.param(tiling.SinkhornTiles(32, **kw), id=name) for name, kw in SINKHORN_FORMS.items()
]


@pytest.mark.parametrize("tiles", SINKHORN_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_sinkhorn(emu, n, variant, dtype, tiles):
    """Sinkhorn fwd + bwd matches the reference, 5 iterations, 37 matrices (2 blocks of 32 for the
    per-element formulation)."""
    with tiling.overridden(**({} if tiles is None else {"sinkhorn": tiles})):
        compare(
            f"sinkhorn {tiles} n{n} {variant} {dtype}",
            lambda z: emu.sinkhorn(z, 5, None, variant),
            lambda z: ref.sinkhorn(z, 5, None, variant),
            sinkhorn_inputs(n, dtype, "cpu"),
            dtype,
            input_names=("logits",),
        )


@pytest.mark.parametrize(
    "tiles", [None, tiling.SinkhornTiles(64, per_element=True)], ids=["default", "per_element"]
)
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
        lambda h_res, residual, h_post, y, bias: ref.h_post_bda(
            h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=variant
        ),
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
        lambda h_res, residual, h_post, y, bias: ref.h_post_bda(
            h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=variant
        ),
        post_bda_inputs(21, 8, 300, torch.float32, torch.float32, True, "cpu"),
        torch.float32,
        input_names=POST_BDA_INPUT_NAMES,
    )


# h_post_bda: both mix orientations, with and without bias, n = 2 / 4 / 8; h_aggregate: n only.
_POST_BDA_CASES = [
    (4, Variant.MEGATRON_DEV, True),
    (4, Variant.MEGATRON_MAIN, False),
    (2, Variant.PAPER, True),
    (8, Variant.MEGATRON_DEV, False),
]
_SLICES, _TUPLE, _WHOLE = tiling.StreamLayout.SLICES, tiling.StreamLayout.TUPLE, tiling.StreamLayout.WHOLE
STREAM_FORM_CASES = [
    pytest.param("h_aggregate", _SLICES, n, None, False, id=f"h_aggregate-slices-n{n}") for n in (2, 4, 8)
] + [
    pytest.param(
        "h_post_bda", mode, n, v, b, id=f"h_post_bda-{mode.name.lower()}-n{n}-{v.value}{'-bias' if b else ''}"
    )
    for mode in (_SLICES, _TUPLE)
    for n, v, b in _POST_BDA_CASES
]


@pytest.mark.parametrize("loop_c", [False, True], ids=["grid_c", "loop_c"])
@pytest.mark.parametrize(("op", "mode", "n", "variant", "with_bias"), STREAM_FORM_CASES)
def test_stream_formulations(emu, op, mode, n, variant, with_bias, loop_c):
    """Each stream-kernel formulation (`StreamTiles.per_stream`: the forwards' slices or tuple, the
    h_post_bda backward's whole tiles or tuple; the forward's C loop, `loop_c`) matches the reference."""
    t, c = 21, 300
    tiles = tiling.StreamTiles(tile_t=8, tile_c=128, per_stream=mode, loop_c=loop_c)
    if op == "h_aggregate":
        kernel, oracle, inputs, names = (
            emu.h_aggregate,
            ref.h_aggregate,
            aggregate_inputs(t, n, c, torch.bfloat16, torch.float32, "cpu"),
            ("x", "h_pre"),
        )
    else:
        kernel = lambda *a: emu.h_post_bda(*a, 0.0, False, variant)  # noqa: E731

        def post_bda(h_res, residual, h_post, y, bias):
            return ref.h_post_bda(
                h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=variant
            )

        oracle = post_bda
        inputs = post_bda_inputs(t, n, c, torch.bfloat16, torch.float32, with_bias, "cpu")
        names = POST_BDA_INPUT_NAMES
    overrides = {f"{op}_fwd": tiles}
    if op == "h_post_bda":
        # loop_c: the backward always loops; its layouts are whole tiles or the tuple
        overrides["h_post_bda_bwd"] = tiling.StreamTiles(
            tile_t=8, tile_c=128, per_stream=_TUPLE if mode == _TUPLE else _WHOLE
        )
    with tiling.overridden(**overrides):
        compare(f"{op} {tiles} n{n} {variant}", kernel, oracle, inputs, torch.bfloat16, input_names=names)


def test_unchecked_access_past_its_array_raises():
    """The interpreter's `ct.load` / `ct.store` with `check_bounds=False` raise, naming the tile and the
    array, for a tile that runs past the array (undefined behaviour on the GPU), and access a whole tile
    as the checked ones do."""
    shim = emulated_tile.EmulatedTile()
    a = torch.arange(40.0).reshape(5, 8)
    assert torch.equal(shim.load(a, (1, 0), (2, 8), check_bounds=False), a[2:4])
    with pytest.raises(
        ValueError, match=r"unchecked load .* tile \(2, 0\) of shape \(2, 8\) runs past array \(5, 8\)"
    ):
        shim.load(a, (2, 0), (2, 8), check_bounds=False)
    shim.store(a, (1, 0), torch.zeros(2, 8), check_bounds=False)
    assert a[2:4].eq(0).all() and a[:2].ne(0).any()
    with pytest.raises(
        ValueError, match=r"unchecked store .* tile \(2, 0\) of shape \(2, 8\) runs past array \(5, 8\)"
    ):
        shim.store(a, (2, 0), torch.ones(2, 8), check_bounds=False)
    assert a[4].ne(1).any(), "nothing is written on the way to the error"
    for access in (
        lambda: shim.load(a, (0, 0), (2, 8), check_bounds=1),
        lambda: shim.store(a, (0, 0), torch.ones(2, 8), check_bounds=1),
    ):
        with pytest.raises(ValueError, match="check_bounds=1"):
            access()


@pytest.mark.parametrize(("x_dtype", "coef"), AGG_DTYPES)
@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_aggregate_forward_mma(emu, n, x_dtype, coef):
    """The h_aggregate forward with the sum over streams on the tensor cores (`StreamTiles.mma`: bf16
    products, fp32 coefficients as bf16 hi + lo, 3xTF32 in fp32) matches the reference, fwd + bwd; 3 token
    tiles, the last partial, and a partial C tile, per C tile and C-looping."""
    tiles = tiling.StreamTiles(tile_t=8, tile_c=128, mma=True)  # the MMA's N edge is TILE_T
    inputs = aggregate_inputs(21, n, 300, x_dtype, coef, "cpu")
    for loop_c in (False, True):
        with tiling.overridden(h_aggregate_fwd=dataclasses.replace(tiles, loop_c=loop_c)):
            compare(
                f"h_aggregate mma fwd n{n} loop_c={loop_c}",
                emu.h_aggregate,
                ref.h_aggregate,
                inputs,
                x_dtype,
                input_names=("x", "h_pre"),
            )


@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_aggregate_forward_mma_keeps_fp32_coefficients(emu, n):
    """With bf16 activations and fp32 coefficients (`megatron_dev`), the tensor-core h_aggregate forward
    gives the reference's bf16 output bit for bit in >= 99 % of the elements (the coefficients go in as
    bf16 hi + lo; rounding them to bf16 once leaves only 62-77 % equal)."""
    with torch.no_grad():
        inputs = aggregate_inputs(64, n, 512, torch.bfloat16, torch.float32, "cpu")
        with tiling.overridden(h_aggregate_fwd=tiling.StreamTiles(8, 128, mma=True)):
            out = emu.h_aggregate(*inputs)
        want = ref.h_aggregate(*inputs)
    equal = float((out == want).float().mean())
    assert equal >= 0.99, (
        f"h_aggregate n={n}: {equal:.2%} of {out.numel()} outputs equal the reference's bits (< 99 %)"
    )


def test_mma_needs_tensor_core_sized_tiles():
    """`StreamTiles.mma` takes the tensor-core path only where the MMA reduces over >= 16 and has edges
    of >= 8 (small tiles: tiny C, few tokens, keep the CUDA cores); the precision follows the dtypes."""
    from mhc_core.kernels.cutile.constants import MMA_2XBF16, MMA_3XTF32, MMA_BF16
    from mhc_core.kernels.cutile.streams import _tensor_cores

    bf16, fp32 = torch.bfloat16, torch.float32
    assert _tensor_cores(True, 64, (32,), bf16, True) == (1, MMA_BF16)
    assert _tensor_cores(True, 64, (32,), bf16, False) == (1, MMA_2XBF16)  # fp32 coefficients: hi + lo
    assert _tensor_cores(True, 64, (32,), fp32, True) == (1, MMA_3XTF32)
    assert _tensor_cores(False, 64, (32,), bf16, True)[0] == 0
    assert _tensor_cores(True, 8, (32,), bf16, True)[0] == 0  # K = 8
    assert _tensor_cores(True, 32, (256, 4), bf16, True)[0] == 0  # an edge of 4


def test_tile_override_is_scoped_and_checked():
    """`tiling.overridden` applies inside its block only and refuses tiles that are not powers of two."""
    default = tiling.aggregate_tiles(4, 4096, "fwd")
    tile = tiling.StreamTiles(tile_t=16, tile_c=256, per_stream=tiling.StreamLayout.SLICES)
    with tiling.overridden(h_aggregate_fwd=tile, sinkhorn=tiling.SinkhornTiles(8, True)):
        assert tiling.aggregate_tiles(4, 4096, "fwd") == tile
        assert tiling.sinkhorn_tile(4) == tiling.SinkhornTiles(8, True)
    assert tiling.aggregate_tiles(4, 4096, "fwd") == default
    with pytest.raises(ValueError, match="powers of two"):
        with tiling.overridden(h_post_bda_bwd=tiling.StreamTiles(tile_t=3, tile_c=128)):
            pass
    with pytest.raises(ValueError, match="unknown key"):
        with tiling.overridden(h_aggregate=8):
            pass


@pytest.mark.parametrize(
    ("key", "tile", "match"),
    [
        (
            "h_post_bda_bwd",
            tiling.StreamTiles(8, 64, per_stream=tiling.StreamLayout.SLICES),
            r"no h_post_bda_bwd kernel for per_stream=SLICES; the kernels have: .*per_stream=TUPLE",
        ),
        (
            "h_post_bda_fwd",
            tiling.StreamTiles(4, 256, mma=True),
            "no h_post_bda_fwd kernel for per_stream=WHOLE, mma=True",
        ),
        ("h_aggregate_fwd", tiling.StreamTiles(8, 256), "no h_aggregate_fwd kernel for per_stream=WHOLE"),
        ("h_aggregate_bwd", tiling.StreamTiles(8, 256, loop_c=True), "loop_c applies to the forwards"),
        ("h_post_bda_fwd", tiling.StreamTiles(4, 256, per_stream=3), "per_stream must be a StreamLayout"),
        ("sinkhorn", tiling.SinkhornTiles(64, per_element=1), "per_element must be a bool"),
    ],
    ids=["bwd-slices", "fwd-mma", "aggregate-whole-without-mma", "bwd-loop_c", "layout-3", "per_element-int"],
)
def test_formulations_the_kernels_lack_are_refused(key, tile, match):
    """A tile naming a formulation no kernel has (`tiling.STREAM_FORMULATIONS`; the retired ones are
    declared in `tools/cutile/retired.py`) is refused with the key, the tile and what the kernel has."""
    with pytest.raises(ValueError, match=match):
        with tiling.overridden(**{key: tile}):
            pass


def test_stream_layout_reads_its_number():
    """`StreamTiles.per_stream` takes a `StreamLayout` or its number (tuning files, older sweep candidates:
    True is SLICES) and reprs by name."""
    assert tiling.StreamTiles(4, 256, per_stream=2).per_stream is tiling.StreamLayout.TUPLE
    assert tiling.StreamTiles(4, 256, per_stream=True).per_stream is tiling.StreamLayout.SLICES
    assert tiling.StreamTiles(4, 256, per_stream=2) == tiling.StreamTiles(
        4, 256, per_stream=tiling.StreamLayout.TUPLE
    )
    assert "per_stream=StreamLayout.TUPLE" in repr(tiling.StreamTiles(4, 256, per_stream=2))
    assert tiling.tile_fields(tiling.StreamTiles(4, 256, per_stream=2))["per_stream"] == 2


MAPPING_SHAPES = [
    pytest.param(20, 300, id="T20-C300"),  # 2 K splits in the forward
    pytest.param(520, 48, id="T520-C48"),  # 2 token splits in the backward
]


@pytest.mark.parametrize("bwd", [None, tiling.MappingTiles(tile_m=16, tile_k=64)], ids=["default", "16x64"])
@pytest.mark.parametrize(("t", "c"), MAPPING_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_mapping(emu, n, variant, dtype, t, c, bwd):
    """mapping fwd + bwd (split-K forward, split-token backward) matches the reference, at the default and
    a 16 x 64 backward tile."""
    oracle = None
    if variant == Variant.MEGATRON_MAIN and dtype == torch.bfloat16:
        oracle = mapping_oracle(n, variant)
    with tiling.overridden(**({} if bwd is None else {"mapping_bwd": bwd})):
        compare(
            f"mapping n{n} {variant} {dtype} T{t} C{c} {bwd}",
            lambda *a: emu.mapping(*a, n, variant),
            lambda x, w, a_pre, a_post, a_res, b: ref.mapping(
                x, w, a_pre, a_post, a_res, b, n=n, variant=variant
            ),
            mapping_inputs(t, n, c, dtype, "cpu"),
            dtype,
            input_names=MAPPING_INPUT_NAMES,
            cosine_inputs=MAPPING_COSINE,
            oracle_fn=oracle,
        )


@pytest.mark.parametrize(
    "variant", ["megatron_dev+eps_inside_sqrt", "megatron_main+eps_inside_sqrt+fp32_mappings"]
)
def test_mapping_numerics_options(emu, variant):
    """The eps inside the square root (and fp32 mappings on megatron_main) match the reference, fwd + bwd,
    with x at RMS 1e-3 where the eps placement shows."""
    x, *rest = mapping_inputs(20, 4, 300, torch.float32, "cpu")
    compare(
        f"mapping {variant}",
        lambda *a: emu.mapping(*a, 4, variant),
        lambda x, w, a_pre, a_post, a_res, b: ref.mapping(
            x, w, a_pre, a_post, a_res, b, n=4, variant=variant
        ),
        [x * 1e-3, *rest],
        torch.float32,
        input_names=MAPPING_INPUT_NAMES,
        cosine_inputs=MAPPING_COSINE,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_pre(emu, variant, dtype):
    """pre at C = 64 (the default backward K tile, 128, does not divide C: the mapping, Sinkhorn and aggregate
    launches in a row) matches the reference, fwd + bwd, n = 4."""
    compare(
        f"pre {variant} {dtype}",
        lambda *a: emu.pre(*a, 4, 5, variant),
        lambda x, w, a_pre, a_post, a_res, b: ref.pre(
            x, w, a_pre, a_post, a_res, b, n=4, iterations=5, variant=variant
        ),
        mapping_inputs(20, 4, 64, dtype, "cpu"),
        dtype,
        input_names=MAPPING_INPUT_NAMES,
        cosine_inputs=MAPPING_COSINE,
    )


@pytest.mark.parametrize("entry", [False, True], ids=["mid", "entry"])
def test_single_pass_pre(emu, entry):
    """The single-pass pre (DeepSeek-V4.1's numerics: the mapping, Sinkhorn and aggregate launches, the aggregate
    with the previous sublayer's H_pre, stream 0 at the model's entry) matches the reference, fwd + bwd, n = 4."""
    inputs = mapping_inputs(20, 4, 64, torch.float32, "cpu")
    mix = None if entry else 0.2 + torch.rand(20, 4, generator=torch.Generator().manual_seed(5))
    names = (*MAPPING_INPUT_NAMES, "previous_h_pre")

    def single_pass(ops_):
        return lambda x, w, a_pre, a_post, a_res, b, prev: ops_.single_pass_pre(
            x, prev, w, a_pre, a_post, a_res, b, n=4, iterations=5, variant="deepseek_v41"
        )

    compare(
        f"single_pass_pre {'entry' if entry else 'mid'}",
        single_pass(emu),
        single_pass(ref),
        [*inputs, mix],
        torch.float32,
        input_names=names,
        cosine_inputs=MAPPING_COSINE,
    )


class _LaunchLog(EmulatedRuntime):
    """The emulator, recording the kernel of every launch."""

    def __init__(self) -> None:
        super().__init__(num_sms=4)
        self.names: list[str] = []

    def launch(self, grid, kernel_name, args):
        self.names.append(kernel_name)
        super().launch(grid, kernel_name, args)


PRE_CASES = [
    pytest.param(v, d, None, id=f"{VARIANT_NAMES[v]}-{DTYPE_NAMES[d]}-default")
    for v in Variant
    for d in (torch.float32, torch.bfloat16)
] + [
    pytest.param(Variant.MEGATRON_DEV, torch.bfloat16, tiles, id=f"dev-bf16-{name}")
    for name, tiles in MAPPING_BWD_TILES.items()
]
"""Every variant and dtype under the default tiles; the sweep's backward tiles for one."""


def _check_pre_fused(n: int, t: int, c: int, variant, dtype, tiles=None) -> None:
    """`PreTiles(fused=True)` pre against the reference at `[t, n*c]`, fwd + bwd (bf16 against fp64, `pre_oracle`:
    the reference rounds the aggregate's gradient of h_pre to bf16, the kernels keep it in fp32), under the
    backward tiles `tiles`; its backward writes one gradient of x: no aggregate backward, no plain mapping dx."""
    rt = _LaunchLog()
    ops = bound_ops(CuTileBackend(rt))
    with tiling.overridden(
        pre=tiling.PreTiles(fused=True), **({} if tiles is None else {"mapping_bwd": tiles})
    ):
        compare(
            f"pre fused {tiles} n{n} {variant} {dtype}",
            lambda *a: ops.pre(*a, n, 20, variant),
            lambda x, w, a_pre, a_post, a_res, b: ref.pre(
                x, w, a_pre, a_post, a_res, b, n=n, iterations=20, variant=variant
            ),
            mapping_inputs(t, n, c, dtype, "cpu"),
            dtype,
            input_names=MAPPING_INPUT_NAMES,
            cosine_inputs=MAPPING_COSINE,
            oracle_fn=pre_oracle(n, variant, 20) if dtype == torch.bfloat16 else None,
            out_kind="proj",
            row_scaled=("weight",),
        )
    assert {"h_aggregate_bwd_h_kernel", "pre_bwd_dx_dw_kernel"} <= set(rt.names), rt.names
    assert not {"h_aggregate_bwd_kernel", "mapping_bwd_dx_dw_kernel"} & set(rt.names), rt.names


@pytest.mark.parametrize(("variant", "dtype", "tiles"), PRE_CASES)
def test_pre_fused(variant, dtype, tiles):
    """pre fused (the aggregate's gradient of h_pre alone, then the mapping's dx kernel with the aggregate's
    share of grad x in it) matches the reference, n = 4, T300 C1024 (partial token tiles)."""
    _check_pre_fused(4, 300, 1024, variant, dtype, tiles)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize(
    ("variant", "dtype"), [(Variant.MEGATRON_DEV, torch.float32), (Variant.MEGATRON_MAIN, torch.bfloat16)]
)
def test_pre_fused_other_n(n, variant, dtype):
    """The fused pre at n = 2 and 8 (the dx kernel finds each K tile's stream from C / TILE_K), T37 C256 with
    the default 128-wide backward K tile: two tiles per stream, a partial token tile."""
    _check_pre_fused(n, 37, 256, variant, dtype)


def test_pre_fuses_where_the_backward_k_tile_divides_c():
    """The fused pre-op covers C where the mapping backward's K tile divides it (each dx tile in one stream);
    elsewhere the pre-op falls back to the three ops."""
    with tiling.overridden(mapping_bwd=tiling.MappingTiles(tile_m=16, tile_k=128)):
        assert pre_fuses(4, 4 * 4096) and pre_fuses(4, 4 * 384) and pre_fuses(2, 2 * 128)
        assert not pre_fuses(4, 4 * 64) and not pre_fuses(4, 4 * 300)
    with tiling.overridden(mapping_bwd=tiling.MappingTiles(tile_m=16, tile_k=256)):
        assert not pre_fuses(4, 4 * 384)


def test_mapping_n8(emu):
    """n = 8 (N = 80: pre/post tile 16, res tile 64)."""
    compare(
        "mapping n8",
        lambda *a: emu.mapping(*a, 8, Variant.MEGATRON_DEV),
        lambda x, w, a_pre, a_post, a_res, b: ref.mapping(
            x, w, a_pre, a_post, a_res, b, n=8, variant=Variant.MEGATRON_DEV
        ),
        mapping_inputs(20, 8, 300, torch.float32, "cpu"),
        torch.float32,
        input_names=MAPPING_INPUT_NAMES,
    )
