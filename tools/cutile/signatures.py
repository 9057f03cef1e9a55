"""Every kernel signature the cuTile backend launches, for export / compile checks in CI.

The list is not written by hand: `signature_plan()` runs the real launch wrappers (`ops_*.py`)
forward and backward on small CPU tensors through `RecordingRuntime`, for every supported
`n`, activation dtype (bf16, fp32), variant, parameter dtype and bias / no bias, and keeps each
distinct (kernel, argument kinds) pair once, under the first readable id that produced it
(`h_post_bda-fwd-n4-bf16-main-bias`, `mapping-bwd-n4-fp32-dev-dx_dw`). A launch the dispatch
can produce is therefore in the list by construction, for the tile classes of the representative
sizes: T = 64 (a multiple of 16, like real token counts) with C = 512 (at or above every `TILE_C`
cap in `tiling.py`: every hidden size >= 512) and C = 64 (the functional recipes' toy models; ids
end in `-c64`, and only the stream kernels differ). Other small hidden sizes get other `TILE_C`
values, compiled by the JIT on first use but not listed here.

Array arguments are described the way the cuTile JIT specialises them (base address 16-byte
aligned, unit / 16-byte-divisible strides, dims divisible by 16); `to_signature` turns one
into a `cuda.tile.compilation.KernelSignature` (needs `cuda.tile`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from mhc_core.kernels.cutile import CuTileBackend, tiling
from mhc_core.kernels.cutile.runtime import kernel_object
from mhc_core.kernels.dispatch import bound_ops
from mhc_core.ops.mapping import num_mapping_outputs
from mhc_core.variants import Variant, get_variant
from tools.cutile.recording import ArrayArg, ConstArg, RecordingRuntime, ScalarArg

__all__ = [
    "ALL_VARIANTS",
    "PlannedLaunch",
    "KernelCase",
    "kernel_object",
    "record_all",
    "signature_plan",
    "plan_under",
    "alternative_plan",
    "tuned_plan",
    "ALTERNATIVE_TILES",
    "kernel_cases",
    "to_signature",
    "REPRESENTATIVE_T",
    "REPRESENTATIVE_C",
    "BYTECODE_VERSION",
    "export_bytecode",
    "export_cubin",
]

REPRESENTATIVE_T = 64
REPRESENTATIVE_C = (512, 64)
"""Hidden sizes of the plan: the production tile class first, then the toy-model one."""

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_LABELLING_FIRST = (Variant.MEGATRON_MAIN, Variant.MEGATRON_DEV)
ALL_VARIANTS = (*_LABELLING_FIRST, *(v for v in Variant if v not in _LABELLING_FIRST))
"""Every variant, in the order `record_all` records them: a launch two variants share keeps the first one's tag
in its id (main's, then dev's), so the shipped ids stay put as variants are added."""
_ROLE = {
    "mapping_fwd_partial_kernel": "partial",
    "mapping_fwd_epilogue_kernel": "epilogue",
    "mapping_bwd_coef_kernel": "coef",
    "mapping_bwd_dx_dw_kernel": "dx_dw",
    "h_aggregate_bwd_h_kernel": "grad_h",
    "pre_bwd_dx_dw_kernel": "dx_dw",
}


@dataclass(frozen=True)
class PlannedLaunch:
    """One distinct launch: readable id, kernel name, abstract arguments."""

    id: str
    kernel_name: str
    args: tuple[ArrayArg | ScalarArg | ConstArg, ...]


def _record(rec: RecordingRuntime, label: str, fwd, *inputs: torch.Tensor) -> None:
    """Run `fwd(*inputs)` then a backward through all its outputs, labelling the launches."""
    rec.label = f"{label}|fwd"
    out = fwd(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    rec.label = f"{label}|bwd"
    torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])


def _leaf(shape, dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype).requires_grad_(True)


def _mapping_leaves(t: int, n: int, c: int, act: torch.dtype, pdt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The inputs of `mapping` / `pre`: `x [t, n*c]` in `act`, weight, alphas and bias in `pdt`."""
    big_n = num_mapping_outputs(n)
    return (
        _leaf((t, n * c), act),
        _leaf((big_n, n * c), pdt),
        _leaf((1,), pdt),
        _leaf((1,), pdt),
        _leaf((1,), pdt),
        _leaf((big_n,), pdt),
    )


def record_all(
    rec: RecordingRuntime,
    ns: Iterable[int],
    t: int,
    cs: tuple[int, ...],
    acts: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    variants: tuple[Variant, ...] = ALL_VARIANTS,
) -> None:
    """Every op forward and backward through `rec` at `[t, n, c]` for each `n`, `c` and activation
    dtype, each of `variants` (default all), parameter dtype and bias / no bias (launch labels
    `op|tag|direction`)."""
    ops = bound_ops(CuTileBackend(rec))
    for c, n in ((c, n) for c in cs for n in ns):
        c_tag = "" if c == cs[0] else f"-c{c}"
        for act in acts:
            for variant in variants:
                spec = get_variant(variant)
                coef = act if spec.coefficients_in_activation_dtype else torch.float32
                tag = f"n{n}-{_DTYPE_NAMES[act]}-{variant.tag}{c_tag}"
                param_dtypes = [torch.float32]
                if not spec.params_fp32 and act != torch.float32:
                    param_dtypes.append(act)  # Float16Module casts main's params to bf16 (mhc_core.precision)
                for pdt in param_dtypes:
                    suffix = "" if pdt == torch.float32 else f"-params_{_DTYPE_NAMES[pdt]}"
                    _record(
                        rec,
                        f"mapping|{tag}{suffix}",
                        lambda x, w, a, b, d, bias, n=n, v=variant: ops.mapping(x, w, a, b, d, bias, n, v),
                        *_mapping_leaves(t, n, c, act, pdt),
                    )
                _record(
                    rec,
                    f"sinkhorn|{tag}",
                    lambda z, v=variant: ops.sinkhorn(z, 3, None, v),
                    _leaf((t, n, n), coef),
                )
                _record(
                    rec, f"h_aggregate|{tag}", ops.h_aggregate, _leaf((t, n, c), act), _leaf((t, n), coef)
                )
                for with_bias in (False, True):
                    bias = _leaf((c,), act) if with_bias else None
                    _record(
                        rec,
                        f"h_post_bda|{tag}" + ("-bias" if with_bias else ""),
                        lambda hr, r, hp, y, b=bias, v=variant: ops.h_post_bda(hr, r, hp, y, b, 0.0, True, v),
                        _leaf((t, n, n), coef),
                        _leaf((t, n, c), act),
                        _leaf((t, n), coef),
                        _leaf((t, c), act),
                    )
                # After the ops it fuses, so that its launches of their kernels keep their ids; its fused
                # formulation (the composition launches the kernels above).
                for pdt in param_dtypes:
                    suffix = "" if pdt == torch.float32 else f"-params_{_DTYPE_NAMES[pdt]}"
                    with tiling.overridden(pre=tiling.PreTiles(fused=True)):
                        _record(
                            rec,
                            f"pre|{tag}{suffix}",
                            lambda x, w, a, b, d, bias, n=n, v=variant: ops.pre(x, w, a, b, d, bias, n, 3, v),
                            *_mapping_leaves(t, n, c, act, pdt),
                        )


def _distinct(rec: RecordingRuntime, prefix: str = "") -> tuple[PlannedLaunch, ...]:
    """Each distinct (kernel, argument kinds) pair of `rec`'s launches once, under its first id."""
    seen: dict[tuple, PlannedLaunch] = {}
    for launch in rec.launches:
        key = (launch.kernel_name, launch.args)
        if key in seen:
            continue
        op, tag, direction = launch.label.split("|")
        role = _ROLE.get(launch.kernel_name)
        ident = f"{prefix}{op}-{direction}-{tag}" + (f"-{role}" if role else "")
        seen[key] = PlannedLaunch(id=ident, kernel_name=launch.kernel_name, args=launch.args)
    return tuple(seen.values())


@functools.cache
def signature_plan(
    ns: tuple[int, ...] = tiling.SUPPORTED_N,
    t: int = REPRESENTATIVE_T,
    cs: tuple[int, ...] = REPRESENTATIVE_C,
) -> tuple[PlannedLaunch, ...]:
    """Distinct launches of all five ops, forward and backward (CPU only, no `cuda.tile`)."""
    rec = RecordingRuntime()
    record_all(rec, ns, t, cs)
    return _distinct(rec)


_SLICES, _TUPLE = tiling.StreamLayout.SLICES, tiling.StreamLayout.TUPLE
ALTERNATIVE_TILES = (
    {
        "sinkhorn": tiling.SinkhornTiles(tile_b=128, per_element=True),
        "h_aggregate_fwd": tiling.StreamTiles(tile_t=8, tile_c=256, per_stream=_SLICES, loop_c=True),
        "h_post_bda_fwd": tiling.StreamTiles(tile_t=4, tile_c=256, per_stream=_TUPLE),
        "h_post_bda_bwd": tiling.StreamTiles(tile_t=8, tile_c=64, per_stream=_TUPLE),
        "mapping_bwd": tiling.MappingTiles(tile_m=16, tile_k=64),
    },
    {
        "h_aggregate_fwd": tiling.StreamTiles(tile_t=8, tile_c=256, mma=True),
        "h_post_bda_fwd": tiling.StreamTiles(tile_t=4, tile_c=256, per_stream=_TUPLE, loop_c=True),
    },
    {
        "h_aggregate_fwd": tiling.StreamTiles(tile_t=8, tile_c=256, mma=True, loop_c=True),
        "h_post_bda_fwd": tiling.StreamTiles(tile_t=4, tile_c=256, per_stream=_SLICES, loop_c=True),
    },
)
"""The formulations the tile sweep can pick besides the defaults: per-element Sinkhorn, the C-looping
stream forwards, the h_aggregate forward with its stream sum on the tensor cores (with and without the C
loop), the stream-by-stream-loading h_post_bda forward (with and without the C loop) and backward, and the
spill-free 16 x 64 mapping backward."""


def plan_under(overrides: dict, n: int = 4, prefix: str = "") -> tuple[PlannedLaunch, ...]:
    """Distinct launches of all five ops at `n`, C = 512, inside `tiling.overridden(**overrides)`
    (ids prefixed `prefix`): what the dispatch launches for one set of tiles."""
    rec = RecordingRuntime()
    with tiling.overridden(**overrides):
        record_all(rec, (n,), REPRESENTATIVE_T, REPRESENTATIVE_C[:1])
    return _distinct(rec, prefix=prefix)


def _beyond_default(plans: Iterable[tuple[PlannedLaunch, ...]]) -> tuple[PlannedLaunch, ...]:
    """The launches of `plans`, each (kernel, arguments) once, that the default plan does not hold
    (launches an override or a tuning leaves alone equal the default plan's and drop out here)."""
    seen = {(p.kernel_name, p.args) for p in signature_plan()}
    out = []
    for plan in plans:
        for p in plan:
            if (p.kernel_name, p.args) not in seen:
                seen.add((p.kernel_name, p.args))
                out.append(p)
    return tuple(out)


@functools.cache
def alternative_plan(n: int = 4) -> tuple[PlannedLaunch, ...]:
    """Launches (ids prefixed `alt<i>-`) of the `ALTERNATIVE_TILES` formulations at `n`, C = 512 that
    the default plan does not hold."""
    return _beyond_default(
        plan_under(overrides, n, prefix=f"alt{i}-") for i, overrides in enumerate(ALTERNATIVE_TILES)
    )


def _plan_tuned(t) -> tuple[PlannedLaunch, ...]:
    """Distinct launches of all five ops under tuning `t`, at its `n` and both representative hidden sizes."""
    from mhc_core.kernels.cutile import tuning

    rec = RecordingRuntime()
    with tiling.tuned(t):
        record_all(rec, (t.n,), REPRESENTATIVE_T, REPRESENTATIVE_C)
    return _distinct(rec, prefix=f"tuned-{tuning.device_slug(t.device)}-")


def tuned_plan(tunings: Iterable | None = None) -> tuple[PlannedLaunch, ...]:
    """Launches (ids prefixed `tuned-<device slug>-`) of each tuning (default: those shipped in
    `tuning.TUNED_DIR`) at its `n`, both representative hidden sizes, every dtype and variant, that
    the default plan does not hold: what the dispatch launches on that GPU model."""
    from mhc_core.kernels.cutile import tuning

    if tunings is None:
        tunings = [tuning.load(p) for p in sorted(tuning.TUNED_DIR.glob("*.json"))]
    return _beyond_default(_plan_tuned(t) for t in tunings)


# ---------------------------------------------------------------------------------------------
# conversion to cuda.tile signatures (imports cuda.tile)
# ---------------------------------------------------------------------------------------------


BYTECODE_VERSION = "13.3"
"""The TileIR bytecode the offline checks export (the first with Hopper support), so that a kernel
a 13.3 compiler cannot take fails here."""


def _export(launch: PlannedLaunch, kernel, **options) -> bytes:
    """`export_kernel` of `launch` for `kernel` (default `kernel_object(launch.kernel_name)`, the hint in
    force) with cuTile's output `options`; imports `cuda.tile`."""
    import io

    from cuda.tile.compilation import export_kernel

    buf = io.BytesIO()
    export_kernel(
        kernel_object(launch.kernel_name) if kernel is None else kernel,
        [to_signature(launch)],
        buf,
        **options,
    )
    return buf.getvalue()


def export_bytecode(launch: PlannedLaunch, kernel=None) -> bytes:
    """TileIR bytecode of `launch` at `BYTECODE_VERSION`, for `kernel` (default
    `kernel_object(launch.kernel_name)`, the hint in force; imports `cuda.tile`)."""
    return _export(launch, kernel, output_format="tileir_bytecode", bytecode_version=BYTECODE_VERSION)


def export_cubin(launch: PlannedLaunch, arch: str, kernel=None) -> bytes:
    """The cubin tileiras builds for `launch` on `arch` ("sm_90", "sm_100"), for `kernel` (default
    `kernel_object(launch.kernel_name)`, the hint in force); through cuTile's own export, so its cubin
    disk cache (`CUDA_TILE_CACHE_DIR`) sees it. Imports `cuda.tile`; needs tileiras."""
    return _export(launch, kernel, output_format="cubin", gpu_code=arch)


def _ct_dtype(ct, dtype: torch.dtype):
    return {torch.bfloat16: ct.bfloat16, torch.float32: ct.float32, torch.float16: ct.float16}[dtype]


def to_signature(launch: PlannedLaunch):
    """The `KernelSignature` the JIT compiles one planned launch with: calling convention
    `cutile_python_v2` with size-1 dims as shape constants when an array has one, else
    `cutile_python_v1` (the JIT's own choice; `precompile` relies on the two being equal)."""
    import cuda.tile as ct
    from cuda.tile import compilation as ctc

    params = []
    for a in launch.args:
        if isinstance(a, ArrayArg):
            extra = (
                {"shape_constant": tuple(1 if one else None for one in a.shape_one)} if a.shape_one else {}
            )
            params.append(
                ctc.ArrayConstraint(
                    _ct_dtype(ct, a.dtype),
                    a.ndim,
                    index_dtype=ct.int32,
                    stride_lower_bound_incl=0,
                    alias_groups=(),
                    may_alias_internally=False,
                    stride_constant=tuple(1 if one else None for one in a.stride_one),
                    stride_divisible_by=a.stride_div,
                    shape_divisible_by=tuple(16 if d else 1 for d in a.shape_16),
                    base_addr_divisible_by=16 if a.base_16 else 1,
                    **extra,
                )
            )
        elif isinstance(a, ScalarArg):
            params.append(ctc.ScalarConstraint(ct.int32 if a.kind == "int32" else ct.float32))
        else:
            params.append(ctc.ConstantConstraint(a.value))
    v2 = any(isinstance(a, ArrayArg) and a.shape_one for a in launch.args)
    conv = ctc.CallingConvention.cutile_python_v2() if v2 else ctc.CallingConvention.cutile_python_v1()
    return ctc.KernelSignature(params, conv)


@dataclass(frozen=True)
class KernelCase:
    """One registry entry: id, kernel name and object, and its signatures (one here)."""

    id: str
    kernel_name: str
    kernel: object
    signatures: tuple


def kernel_cases(ns: tuple[int, ...] = tiling.SUPPORTED_N) -> tuple[KernelCase, ...]:
    """The registry as `KernelCase`s (imports `cuda.tile`)."""
    return tuple(
        KernelCase(
            id=p.id,
            kernel_name=p.kernel_name,
            kernel=kernel_object(p.kernel_name),
            signatures=(to_signature(p),),
        )
        for p in signature_plan(tuple(ns))
    )


def iter_signatures(ns: tuple[int, ...] = tiling.SUPPORTED_N) -> Iterator[tuple[str, object, list]]:
    """`(id, kernel object, [KernelSignature])` for every launch the dispatch can produce."""
    for case in kernel_cases(ns):
        yield case.id, case.kernel, list(case.signatures)
