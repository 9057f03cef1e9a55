"""The four mHC ops on cuTile kernels, bundled per runtime: `make_ops(runtime) -> CuTileOps`.

Each op has its reference signature (`mhc_core.ops`) and is differentiable through a
`torch.autograd.Function` whose forward and backward are cuTile launches. Launches go through
a runtime (`runtime.py`): the GPU, the CPU emulator or the signature recorder. The launch
wrappers live one op family a module: `ops_sinkhorn.py`, `ops_mapping.py`, `ops_streams.py`
(`h_aggregate`, `h_post_bda`), with the shared constants and checks in `ops_common.py`.

Bad arguments raise the reference's `ValueError`s (the reference's own check functions, shared
by every backend). Cases without a kernel raise `NotImplementedError` naming the case: `n`
outside `tiling.SUPPORTED_N`, dtypes other than bf16 / fp32 (fp16, fp64), dropout > 0 in
training, tensors not on a CUDA device. Unlike the reference ops, the kernels do not check their
inputs for NaN / inf (that check syncs the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from mhc_core.kernels.cutile import ops_mapping, ops_sinkhorn, ops_streams
from mhc_core.kernels.cutile.ops_common import SUPPORTED_DTYPES, VARIANT_CODE, mma_mode
from mhc_core.ops.mapping import NORM_EPS
from mhc_core.variants import Variant

__all__ = ["CuTileOps", "make_ops", "mma_mode", "VARIANT_CODE", "SUPPORTED_DTYPES"]


class CuTileOps(NamedTuple):
    """The four ops, each with the reference signature, bound to one runtime."""

    sinkhorn: Callable
    mapping: Callable
    h_aggregate: Callable
    h_post_bda: Callable


def make_ops(runtime: Any | Callable[[], Any]) -> CuTileOps:
    """Bind the ops to `runtime` (an object with `launch`, or a zero-argument factory of one)."""
    get = runtime if callable(runtime) and not hasattr(runtime, "launch") else (lambda: runtime)

    def sinkhorn(logits, iterations=20, eps=None, variant=Variant.MEGATRON_MAIN):
        """cuTile `mhc_core.ops.sinkhorn`: `[..., n, n] -> [..., n, n]`."""
        return ops_sinkhorn.sinkhorn(get, logits, iterations, eps, variant)

    def mapping(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant=Variant.MEGATRON_MAIN,
                norm_eps=NORM_EPS):
        """cuTile `mhc_core.ops.mapping`: `x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`."""
        return ops_mapping.mapping(get, x, weight, alpha_pre, alpha_post, alpha_res, bias, n, variant, norm_eps)

    def h_aggregate(x, h_pre):
        """cuTile `mhc_core.ops.h_aggregate`: `x [T, n, C], h_pre [T, n] -> [T, C]`."""
        return ops_streams.h_aggregate(get, x, h_pre)

    def h_post_bda(h_res, residual, h_post, y, bias, dropout_p=0.0, training=False,
                   variant=Variant.MEGATRON_MAIN):
        """cuTile `mhc_core.ops.h_post_bda`: `-> [T, n, C]` (no dropout in training)."""
        return ops_streams.h_post_bda(get, h_res, residual, h_post, y, bias, dropout_p, training, variant)

    return CuTileOps(sinkhorn=sinkhorn, mapping=mapping, h_aggregate=h_aggregate, h_post_bda=h_post_bda)
