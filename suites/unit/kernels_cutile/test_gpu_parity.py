"""Compiled cuTile kernels on the GPU, forward and backward, against the reference ops.

Skipped with the reason from `availability()` where there is no GPU (cc >= 8.0), no `cuda.tile`
or no `tileiras`. Tolerances: `mhc_core.testing` (fp32 tight; bf16 2e-2 fwd, 5e-2 bwd, and
cosine >= 0.999 for the alpha / bias gradients). Two sizes per op: a small odd one (partial
tiles everywhere) and one at production tile sizes (C >= 512, all tile caps reached).
"""

from __future__ import annotations

import pytest
import torch

import mhc_core.kernels.cutile as cutile
from mhc_core import ops as ref
from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.mapping import pre_fuses
from mhc_core.kernels.dispatch import bound_ops
from mhc_core.variants import Variant, get_variant
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
from tools.cutile.gpu_cases import (
    MAPPING_BWD_TILES,
    MAPPING_PARITY_SIZES,
    PARITY_SIZES,
    SINKHORN_FORMS,
    STREAM_FORMS,
)

_OK, _WHY = cutile.availability()
CUTILE_OPS = bound_ops(cutile.CUTILE)
"""The public entries on the GPU's cuTile backend."""
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"cuTile backend unavailable: {_WHY}")]

DEV = "cuda"
NS = [pytest.param(n, id=f"n{n}") for n in (2, 4, 8)]
VARIANTS = [pytest.param(v, id=VARIANT_NAMES[v]) for v in Variant]
DTYPES = [pytest.param(d, id=DTYPE_NAMES[d]) for d in (torch.float32, torch.bfloat16)]
SIZES = [pytest.param(t, c, id=f"T{t}-C{c}") for t, c in PARITY_SIZES]
MAPPING_SIZES = [pytest.param(t, c, id=f"T{t}-C{c}") for t, c in MAPPING_PARITY_SIZES]


def _coef_dtype(variant, act):
    return act if get_variant(variant).coefficients_in_activation_dtype else torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", NS)
def test_sinkhorn(n, variant, dtype):
    """Sinkhorn fwd + bwd, 20 iterations, 300 matrices (several blocks, a partial one)."""
    compare(
        f"sinkhorn n{n} {variant}",
        lambda z: CUTILE_OPS.sinkhorn(z, 20, None, variant),
        lambda z: ref.sinkhorn(z, 20, None, variant),
        sinkhorn_inputs(n, _coef_dtype(variant, dtype), DEV, batch=300),
        dtype,
        input_names=("logits",),
    )


@pytest.mark.parametrize(("t", "c"), SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", NS)
def test_h_aggregate(n, variant, dtype, t, c):
    """h_aggregate fwd + bwd with the coefficient dtype the variant produces."""
    compare(
        f"h_aggregate n{n} {variant} T{t} C{c}",
        CUTILE_OPS.h_aggregate,
        ref.h_aggregate,
        aggregate_inputs(t, n, c, dtype, _coef_dtype(variant, dtype), DEV),
        dtype,
        input_names=("x", "h_pre"),
    )


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("t", "c"), SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", NS)
def test_h_post_bda(n, variant, dtype, t, c, with_bias):
    """h_post_bda fwd + bwd, both mix orientations, with and without bias."""
    compare(
        f"h_post_bda n{n} {variant} T{t} C{c} bias={with_bias}",
        lambda *a: CUTILE_OPS.h_post_bda(*a, 0.0, False, variant),
        lambda h_res, residual, h_post, y, bias: ref.h_post_bda(
            h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=variant
        ),
        post_bda_inputs(t, n, c, dtype, _coef_dtype(variant, dtype), with_bias, DEV),
        dtype,
        input_names=POST_BDA_INPUT_NAMES,
        cosine_inputs=("bias",),
    )


@pytest.mark.parametrize(("t", "c"), MAPPING_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", NS)
def test_mapping(n, variant, dtype, t, c):
    """mapping fwd + bwd (split-K forward, split-token backward at the larger size)."""
    oracle = (
        mapping_oracle(n, variant) if (variant == Variant.MEGATRON_MAIN and dtype == torch.bfloat16) else None
    )
    compare(
        f"mapping n{n} {variant} T{t} C{c}",
        lambda *a: CUTILE_OPS.mapping(*a, n, variant),
        lambda x, w, a_pre, a_post, a_res, b: ref.mapping(
            x, w, a_pre, a_post, a_res, b, n=n, variant=variant
        ),
        mapping_inputs(t, n, c, dtype, DEV),
        dtype,
        input_names=MAPPING_INPUT_NAMES,
        cosine_inputs=MAPPING_COSINE,
        oracle_fn=oracle,
        out_kind="proj",
    )


BWD_TILES = [pytest.param(tiles, id=name) for name, tiles in MAPPING_BWD_TILES.items()]


@pytest.mark.parametrize("tiles", BWD_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_mapping_bwd_tiles(n, variant, dtype, tiles):
    """The mapping backward's sweep candidates: the spill-free 16 x 64 tile and the shipped H200 tuning's 16 x 256."""
    oracle = (
        mapping_oracle(n, variant) if (variant == Variant.MEGATRON_MAIN and dtype == torch.bfloat16) else None
    )
    with tiling.overridden(mapping_bwd=tiles):
        compare(
            f"mapping {tiles} n{n} {variant}",
            lambda *a: CUTILE_OPS.mapping(*a, n, variant),
            lambda x, w, a_pre, a_post, a_res, b: ref.mapping(
                x, w, a_pre, a_post, a_res, b, n=n, variant=variant
            ),
            mapping_inputs(1100, n, 1024, dtype, DEV),
            dtype,
            input_names=MAPPING_INPUT_NAMES,
            cosine_inputs=MAPPING_COSINE,
            oracle_fn=oracle,
            out_kind="proj",
        )


@pytest.mark.parametrize("tiles", [pytest.param(None, id="default"), *BWD_TILES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", NS)
def test_pre_fused(n, variant, dtype, tiles):
    """The fused pre-op (`PreTiles(fused=True)`: one gradient of x in the backward), fwd + bwd, at
    T1100 C1024 (the backward's K tiles divide C: the fused launches), under the default backward tiles and the
    sweep's."""
    oracle = pre_oracle(n, variant, 20) if dtype == torch.bfloat16 else None
    with tiling.overridden(
        pre=tiling.PreTiles(fused=True), **({} if tiles is None else {"mapping_bwd": tiles})
    ):
        assert pre_fuses(n, n * 1024)
        compare(
            f"pre {tiles} n{n} {variant}",
            lambda *a: CUTILE_OPS.pre(*a, n, 20, variant),
            lambda x, w, a_pre, a_post, a_res, b: ref.pre(
                x, w, a_pre, a_post, a_res, b, n=n, iterations=20, variant=variant
            ),
            mapping_inputs(1100, n, 1024, dtype, DEV),
            dtype,
            input_names=MAPPING_INPUT_NAMES,
            cosine_inputs=MAPPING_COSINE,
            oracle_fn=oracle,
            out_kind="proj",
            row_scaled=("weight",),
        )


SINKHORN_TILES = [
    pytest.param(tiling.SinkhornTiles(64, **kw), id=name) for name, kw in SINKHORN_FORMS.items()
]


@pytest.mark.parametrize("tiles", SINKHORN_TILES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", NS)
def test_sinkhorn_formulations(n, variant, tiles):
    """The sweep's other Sinkhorn formulations, fwd + bwd, 20 iterations, 300 matrices, fp32 logits."""
    with tiling.overridden(sinkhorn=tiles):
        compare(
            f"sinkhorn {tiles} n{n} {variant}",
            lambda z: CUTILE_OPS.sinkhorn(z, 20, None, variant),
            lambda z: ref.sinkhorn(z, 20, None, variant),
            sinkhorn_inputs(n, torch.float32, DEV, batch=300),
            torch.float32,
            input_names=("logits",),
        )


FORMS = [pytest.param(forms, id=name) for name, forms in STREAM_FORMS.items()]


@pytest.mark.parametrize("forms", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_stream_formulations(variant, dtype, forms):
    """The sweep's other stream-kernel formulations, fwd + bwd with bias, n = 4, T300 C1024."""
    with tiling.overridden(**forms):
        compare(
            f"h_aggregate {forms} {variant}",
            CUTILE_OPS.h_aggregate,
            ref.h_aggregate,
            aggregate_inputs(300, 4, 1024, dtype, _coef_dtype(variant, dtype), DEV),
            dtype,
            input_names=("x", "h_pre"),
        )
        compare(
            f"h_post_bda {forms} {variant}",
            lambda *a: CUTILE_OPS.h_post_bda(*a, 0.0, False, variant),
            lambda h_res, residual, h_post, y, bias: ref.h_post_bda(
                h_res, residual, h_post, y, bias, dropout_p=0.0, training=False, variant=variant
            ),
            post_bda_inputs(300, 4, 1024, dtype, _coef_dtype(variant, dtype), True, DEV),
            dtype,
            input_names=POST_BDA_INPUT_NAMES,
            cosine_inputs=("bias",),
        )


def test_runs_on_the_current_stream():
    """Launches go to the current stream: a result computed on a side stream is complete after its sync."""
    x, h = aggregate_inputs(64, 4, 1024, torch.bfloat16, torch.bfloat16, DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = CUTILE_OPS.h_aggregate(x, h)
    side.synchronize()
    torch.testing.assert_close(out.float(), ref.h_aggregate(x, h).float(), atol=2e-2, rtol=2e-2)
