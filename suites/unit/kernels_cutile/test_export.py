"""Every cuTile launch signature exports to TileIR bytecode; with tileiras, compiles for sm_90 / sm_100.

Needs `cuda.tile` (the tox env `kernels` installs `cuda-tile[tileiras]`), no GPU. The signature
list is the dispatch's own (`signatures.signature_plan`). Cubin tests run for the default n = 4 at
hidden >= 512 here (about a second per kernel and arch); `ci/check_cutile.py --full` compiles all.
cuTile's cubin disk cache applies (`CUDA_TILE_CACHE_DIR=off` before the run disables it).
"""

from __future__ import annotations

import dataclasses
import io
import re

import pytest

ct = pytest.importorskip(
    "cuda.tile", reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')"
)

from cuda.tile.compilation import export_kernel  # noqa: E402

from mhc_core.kernels.cutile import tiling, toolchain, tuning  # noqa: E402
from tools.cutile.recording import ArrayArg, ConstArg  # noqa: E402
from tools.cutile.signatures import (  # noqa: E402
    BYTECODE_VERSION,
    alternative_plan,
    export_bytecode,
    export_cubin,
    kernel_object,
    signature_plan,
    to_signature,
    tuned_plan,
)

PLAN = signature_plan()
CUBIN_N = "-n4-"


@pytest.mark.parametrize("launch", PLAN, ids=[p.id for p in PLAN])
def test_export_bytecode(launch):
    """The kernel type- and shape-checks for this signature and exports TileIR bytecode."""
    assert len(export_bytecode(launch)) > 0


@pytest.fixture(scope="module")
def compiler():
    tc = toolchain.apply_env()
    if tc is None:
        pytest.skip("no tileiras compiler found (pip wheels of cuda-tile[tileiras], PATH or $CUDA_HOME/bin)")
    return tc


CUBIN_PLAN = [p for p in PLAN if CUBIN_N in p.id and "-c64" not in p.id]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("launch", CUBIN_PLAN, ids=[p.id for p in CUBIN_PLAN])
def test_compile_cubin(compiler, launch, arch):
    """tileiras compiles this signature to a cubin for `arch` (Hopper, Blackwell)."""
    assert len(export_cubin(launch, arch)) > 0


ALT_PLAN = alternative_plan()


def test_alternative_plan_holds_each_formulation():
    """The sweep's alternative formulations (per-element Sinkhorn, C-looping and tensor-core h_aggregate
    forwards, the tuple and C-looping h_post_bda forwards, the tuple h_post_bda backward, the 16 x 64 mapping
    backward, which the fused pre-op's backward uses too) are listed, each kernel with the constants that
    select it."""
    kernels = {p.kernel_name for p in ALT_PLAN}
    assert kernels == {
        "sinkhorn_fwd_elem_kernel",
        "sinkhorn_bwd_elem_kernel",
        "h_aggregate_fwd_kernel",
        "h_post_bda_fwd_kernel",
        "h_post_bda_bwd_kernel",
        "mapping_bwd_coef_kernel",
        "mapping_bwd_dx_dw_kernel",
        "pre_bwd_dx_dw_kernel",
    }
    consts = {p.kernel_name: set() for p in ALT_PLAN}
    for p in ALT_PLAN:
        consts[p.kernel_name].add(
            tuple(a.value for a in p.args if isinstance(a, ConstArg))[3:]
        )  # after N, TILE_T, TILE_C
    # h_aggregate fwd (LOOP_C, TENSOR_CORES, MMA): C-looping slices, tensor cores with and without the loop
    assert {c[:2] for c in consts["h_aggregate_fwd_kernel"]} == {(1, 0), (0, 1), (1, 1)}
    # h_post_bda fwd (TRANSPOSED, HAS_BIAS, LOOP_C, TUPLE): the tuple with and without the loop, looping slices
    assert {c[-2:] for c in consts["h_post_bda_fwd_kernel"]} == {(0, 1), (1, 1), (1, 0)}
    assert {c[-1] for c in consts["h_post_bda_bwd_kernel"]} == {1}


def test_plan_exports_at_one_bytecode_version():
    """Every launch of the default plan exports at `BYTECODE_VERSION` (13.3, the first with Hopper), which
    a 13.3 tileiras takes."""
    assert BYTECODE_VERSION == "13.3"
    launch = PLAN[0]
    export_kernel(
        kernel_object(launch.kernel_name),
        [to_signature(launch)],
        io.BytesIO(),
        output_format="tileir_bytecode",
        bytecode_version="13.3",
    )


def _formulation(launch) -> tuple[str, str]:
    """(`alt<i>`, kernel name) of an alternative-plan launch."""
    return launch.id.split("-")[0], launch.kernel_name


def _sweep_subset(plan) -> list:
    """Per formulation and kernel, the bf16 launches labelled with the sweep's variant (`-dev`, with
    and without bias), else the first bf16 one (a signature megatron_dev shares with it)."""
    groups: dict[tuple[str, str], list] = {}
    for p in plan:
        if "-bf16-" in p.id:
            groups.setdefault(_formulation(p), []).append(p)
    return [q for group in groups.values() for q in ([p for p in group if "-dev" in p.id] or group[:1])]


# The sweep (`ci/gpu_check.sh`, `gpu_check prepare`) launches its candidates in bf16 for megatron_dev:
# those launches compile here. The other dtypes and variants of a formulation are launched only once
# a tuning adopts it, and then compile as part of what the tuning ships (`test_compile_shipped_tuning_cubin`,
# every dtype and variant), as does the default plan (`test_compile_cubin`).
ALT_COMPILED = _sweep_subset(ALT_PLAN)


def test_every_alternative_formulation_compiles_as_the_sweep_launches_it():
    """Each formulation and kernel of the alternative plan has a compiled bf16 launch, megatron_dev's where labelled."""
    assert {_formulation(p) for p in ALT_COMPILED} == {_formulation(p) for p in ALT_PLAN}
    assert all("-bf16-" in p.id for p in ALT_COMPILED)
    h_post_bda = [p.id.split("-bf16-")[1] for p in ALT_COMPILED if p.id.startswith("alt0-h_post_bda-bwd")]
    assert sorted(h_post_bda) == ["dev", "dev-bias"], h_post_bda
    assert len(ALT_COMPILED) < len(ALT_PLAN) / 3


@pytest.mark.slow
@pytest.mark.parametrize("launch", ALT_COMPILED, ids=[p.id for p in ALT_COMPILED])
def test_compile_alternative_cubin(compiler, launch):
    """tileiras compiles the sweep's alternative formulations for sm_90 (n = 4, bf16, as the sweep launches them)."""
    assert len(export_cubin(launch, "sm_90")) > 0


_ARCH_OF_MODEL = (
    (re.compile(r"\b(G?H100|G?H200|H800|H20)\b", re.I), "sm_90"),
    (re.compile(r"\b(G?B100|G?B200|G?B300)\b", re.I), "sm_100"),
)


def tuning_archs(device: str) -> list[str]:
    """The archs a tuning swept on `device` runs on: the model's own (a tuning applies on the GPU model
    it was swept on, `tuning.resolve`), both for a model not listed here."""
    return [arch for pattern, arch in _ARCH_OF_MODEL if pattern.search(device)][:1] or ["sm_90", "sm_100"]


def test_tuning_archs_follow_the_gpu_model():
    """Hopper tunings compile for sm_90, Blackwell ones for sm_100, an unknown model for both."""
    assert tuning_archs("NVIDIA H200") == tuning_archs("NVIDIA GH200 480GB") == ["sm_90"]
    assert tuning_archs("NVIDIA B200") == ["sm_100"]
    assert tuning_archs("NVIDIA RTX PRO 6000") == ["sm_90", "sm_100"]


SHIPPED = [
    (t, p, arch)
    for t in (tuning.load(f) for f in sorted(tuning.TUNED_DIR.glob("*.json")))
    for p in tuned_plan([t])
    for arch in tuning_archs(t.device)
]


@pytest.mark.parametrize(
    ("tuned", "launch", "arch"), SHIPPED, ids=[f"{p.id}-{arch}" for _, p, arch in SHIPPED]
)
def test_compile_shipped_tuning_cubin(compiler, tuned, launch, arch):
    """tileiras compiles what each tuning shipped in `tuned/` launches (its tiles and occupancy hints) for
    its GPU model's arch."""
    with tiling.tuned(tuned):
        kernel = kernel_object(launch.kernel_name)
    assert len(export_cubin(launch, arch, kernel)) > 0


def test_tuning_launches_export_with_their_hints():
    """A tuning's launches (tuple h_post_bda backward, occupancy 4) export under the tuning, at
    every dtype and variant, and the hinted kernel object is the tuning's."""
    t = tuning.Tuning(
        device="test",
        n=4,
        tiles={"h_post_bda_bwd": tiling.StreamTiles(8, 64, per_stream=tiling.StreamLayout.TUPLE)},
        occupancy={"h_post_bda_bwd_kernel": 4},
    )
    plan = tuned_plan([t])
    assert {p.kernel_name for p in plan} == {"h_post_bda_bwd_kernel"} and len(plan) >= 6
    with tiling.tuned(t):
        assert (
            kernel_object("h_post_bda_bwd_kernel")._compiler_options.occupancy == 4
        )  # cuda.tile 1.7 internals
        for launch in plan:
            assert len(export_bytecode(launch)) > 0


def test_misshaped_signature_fails():
    """A signature whose `x` has the wrong rank (2 instead of 3) is rejected: the export check has teeth."""
    launch = next(p for p in PLAN if p.kernel_name == "h_aggregate_fwd_kernel")
    x = launch.args[0]
    assert isinstance(x, ArrayArg) and x.ndim == 3
    bad_x = dataclasses.replace(
        x, ndim=2, stride_one=x.stride_one[1:], stride_div=x.stride_div[1:], shape_16=x.shape_16[1:]
    )
    bad = dataclasses.replace(launch, args=(bad_x, *launch.args[1:]))
    with pytest.raises(Exception, match="does not match the array rank"):
        export_bytecode(bad)


def test_wrong_constant_fails():
    """A tile constant that is not a power of two (TILE_C = 96) is rejected at export."""
    launch = next(p for p in PLAN if p.kernel_name == "h_aggregate_fwd_kernel")
    args = list(launch.args)
    args[5] = dataclasses.replace(args[5], value=96)  # (x, h_pre, out, N, TILE_T, TILE_C, LOOP_C, ...)
    with pytest.raises(Exception, match="not a power of two"):
        export_bytecode(dataclasses.replace(launch, args=tuple(args)))
