"""cuTile (NVIDIA `cuda-tile`) kernels for the four mHC ops, forward and backward.

Importing this package needs neither `cuda.tile` nor a GPU: the kernel modules
(`sinkhorn_kernels`, `stream_kernels`, `mapping_kernels`) are imported on first launch
(`runtime.kernel_module`). The kernels and the wrappers share `constants.py` (no imports at all).

- `availability() -> (bool, reason)`: a CUDA GPU of compute capability >= 8.0, `cuda.tile`
  importable and a `tileiras` compiler found (see `toolchain.py`).
- `sinkhorn`, `mapping`, `h_aggregate`, `h_post_bda`: the reference signatures, autograd-capable;
  uncovered cases raise `NotImplementedError` naming the case: `n` outside `tiling.SUPPORTED_N`, dtypes
  other than bf16 / fp32 (fp16, fp64), dropout > 0 in training, tensors not on a CUDA device. Unlike
  the reference ops, the kernels do not check their inputs for NaN / inf (that check syncs the host).
  Bad arguments raise the reference's `ValueError`s (the reference's own check functions).
- `make_ops(runtime)`: the ops (the four and the fused `pre`) bound to another runtime (the lab's CPU
  emulator, the launch recorder): each is a `torch.autograd.Function` (in `sinkhorn.py`, `mapping.py`, `streams.py`) whose
  forward and backward are launches of the family's kernels (`sinkhorn_kernels.py`,
  `mapping_kernels.py`, `stream_kernels.py`) through the runtime (`runtime.py`).
- Every launch signature, for the export / compile checks, is listed by the lab's
  `tools/cutile/signatures.py` (from the launch wrappers themselves).
- Tiles: `tiling` heuristics, or the tuning for this GPU model that `tuning.resolve` finds
  (`MHC_CUTILE_TUNING`, else a file shipped in `tuned/`), put in force on the first launch.

Details, tiling and the CI checks: `docs/cutile.md`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from mhc_core.kernels.cutile import mapping as _mapping
from mhc_core.kernels.cutile import sinkhorn as _sinkhorn
from mhc_core.kernels.cutile import streams as _streams
from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.toolchain import find_toolchain
from mhc_core.ops.mapping import NORM_EPS
from mhc_core.ops.pre import check_pre_args
from mhc_core.variants import Variant, get_variant

__all__ = [
    "CuTileOps",
    "make_ops",
    "availability",
    "sinkhorn",
    "mapping",
    "h_aggregate",
    "h_post_bda",
    "pre",
    "OPS",
    "SUPPORTED_N",
]

class CuTileOps(NamedTuple):
    """The ops, each with the reference signature, bound to one runtime."""

    sinkhorn: Callable
    mapping: Callable
    h_aggregate: Callable
    h_post_bda: Callable
    pre: Callable


def make_ops(runtime: Any | Callable[[], Any]) -> CuTileOps:
    """Bind the ops to `runtime` (an object with `launch`, or a zero-argument factory of one)."""
    get = runtime if callable(runtime) and not hasattr(runtime, "launch") else (lambda: runtime)

    def sinkhorn(logits, iterations=20, eps=None, variant=Variant.MEGATRON_MAIN):
        """cuTile `mhc_core.ops.sinkhorn`: `[..., n, n] -> [..., n, n]`."""
        return _sinkhorn.sinkhorn(get, logits, iterations, eps, variant)

    def mapping(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant=Variant.MEGATRON_MAIN,
                norm_eps=NORM_EPS):
        """cuTile `mhc_core.ops.mapping`: `x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`."""
        return _mapping.mapping(get, x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant, norm_eps)

    def h_aggregate(x, h_pre):
        """cuTile `mhc_core.ops.h_aggregate`: `x [T, n, C], h_pre [T, n] -> [T, C]`."""
        return _streams.h_aggregate(get, x, h_pre)

    def h_post_bda(h_res, residual, h_post, y, bias, dropout_p=0.0, training=False,
                   variant=Variant.MEGATRON_MAIN):
        """cuTile `mhc_core.ops.h_post_bda`: `-> [T, n, C]` (no dropout in training)."""
        return _streams.h_post_bda(get, h_res, residual, h_post, y, bias, dropout_p, training, variant)

    def pre(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations=20, variant=Variant.MEGATRON_MAIN,
            norm_eps=NORM_EPS):
        """cuTile `mhc_core.ops.pre`: `x [T, n*C] -> aggregate [T, C], h_pre, h_post [T, n], h_res [T, n, n]`: the
        mapping, Sinkhorn and aggregate launches in a row, or under `PreTiles(fused=True)` (`tiling.pre_tiles`),
        where the channels fit its tiles, the same forward with a backward that writes one gradient of x
        (`mapping.pre`)."""
        spec = get_variant(variant)
        n, iterations = check_pre_args(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, spec,
                                       op="pre", norm_eps=norm_eps)
        fused = _mapping.pre(get, x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, spec, norm_eps,
                             sinkhorn=sinkhorn)
        if fused is not None:
            return fused
        h_pre, h_post, logits = mapping(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, spec, norm_eps)
        h_res = sinkhorn(logits, iterations, None, spec)
        return h_aggregate(x.reshape(x.shape[0], n, x.shape[1] // n), h_pre), h_pre, h_post, h_res

    return CuTileOps(sinkhorn=sinkhorn, mapping=mapping, h_aggregate=h_aggregate, h_post_bda=h_post_bda, pre=pre)


SUPPORTED_N = tiling.SUPPORTED_N
MIN_COMPUTE_CAPABILITY = (8, 0)
HOPPER_MIN_TILEIRAS = (13, 3)


@functools.cache
def availability() -> tuple[bool, str]:
    """`(True, "...")` when the kernels can run here, else `(False, why not)` (cached)."""
    reasons = []
    import torch

    cc = None
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU (torch.cuda.is_available() is False)")
    else:
        cc = torch.cuda.get_device_capability()
        if cc < MIN_COMPUTE_CAPABILITY:
            reasons.append(f"GPU compute capability {cc[0]}.{cc[1]} < 8.0 (cuTile needs Ampere or newer)")
    try:
        has_ct = importlib.util.find_spec("cuda.tile") is not None
    except (ImportError, ValueError):
        has_ct = False
    if has_ct:
        try:
            import cuda.tile  # noqa: F401
        except Exception as exc:  # a broken install must not break the dispatch
            reasons.append(f"`import cuda.tile` failed: {exc}")
    else:
        reasons.append("cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')")
    tc = find_toolchain()
    if tc is None:
        reasons.append("no tileiras compiler (pip wheels, PATH or $CUDA_HOME/bin)")
    elif cc is not None and cc[0] == 9 and tc.release < HOPPER_MIN_TILEIRAS:
        reasons.append(f"tileiras {tc.version} cannot target sm_90 (Hopper needs >= 13.3)")
    if reasons:
        return False, "; ".join(reasons)
    return True, f"cuTile on sm_{cc[0]}{cc[1]} with tileiras {tc.version} ({tc.source})"


@functools.cache
def _default_runtime():
    ok, why = availability()
    if not ok:
        raise RuntimeError(f"cutile backend unavailable: {why}")
    import torch

    from mhc_core.kernels.cutile import tuning
    from mhc_core.kernels.cutile.runtime import CuTileRuntime

    runtime = CuTileRuntime()
    tuned = tuning.resolve(torch.cuda.get_device_name())
    tiling.set_tuning(tuned)
    logging.getLogger("mhc_core.kernels").info("cuTile tuning: %s", tuning.describe(tuned))
    return runtime


OPS: CuTileOps = make_ops(_default_runtime)
"""The ops on the GPU runtime (created on first call)."""

sinkhorn = OPS.sinkhorn
mapping = OPS.mapping
h_aggregate = OPS.h_aggregate
h_post_bda = OPS.h_post_bda
pre = OPS.pre
