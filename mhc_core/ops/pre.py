"""The pre-op of one mHC sublayer: mapping, Sinkhorn and the aggregate of the streams in one call.

`pre(x[T, n*C], weight[N, n*C], alpha_pre, alpha_post, alpha_res, bias[N], n, iterations, variant)
 -> aggregate[T, C], h_pre[T, n], h_post[T, n], h_res[T, n, n]`

What every sublayer does before its function: the coefficients from the RMS-normalised streams
(`mapping`), the Sinkhorn projection of the residual logits (`sinkhorn`) and the weighted sum of the
streams that is the sublayer's input (`h_aggregate`). This reference is exactly that composition, the
oracle of the fused backends, which read `x` once per pass instead of once per op and produce one
gradient of `x` (`docs/kernels.md`, "The fused pre-op").
"""

from __future__ import annotations

import torch

from mhc_core.ops.aggregate import h_aggregate
from mhc_core.ops.mapping import NORM_EPS, check_mapping_args, mapping
from mhc_core.ops.sinkhorn import check_sinkhorn_args, sinkhorn
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = ["check_pre_args", "pre"]


def check_pre_args(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, spec: VariantSpec, *,
                   op: str = "pre", norm_eps: float = NORM_EPS) -> tuple[int, int]:
    """The argument checks of `pre`, shared by every backend (those of `mapping` and the iteration count of
    `sinkhorn`); returns `(n, iterations)` as Python ints."""
    n = check_mapping_args(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, op=op, norm_eps=norm_eps)
    iterations, _ = check_sinkhorn_args(weight.new_empty(0, n, n), iterations, None, spec, op=op)
    return n, iterations


def pre(
    x: torch.Tensor,
    weight: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    iterations: int = 20,
    variant: str | Variant | VariantSpec = Variant.MEGATRON_MAIN,
    norm_eps: float = NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients and aggregated input of one mHC sublayer for `T` tokens.

    Args:
        x: `[T, n*C]` flattened streams (stream-major); weight `[N, n*C]`; alphas `[1]`; bias `[N]`.
        n: residual streams; iterations: Sinkhorn iterations (>= 1).

    Returns:
        `aggregate [T, C]` (in `x.dtype`), `h_pre [T, n]`, `h_post [T, n]`, `h_res [T, n, n]` (after
        Sinkhorn), each as `mapping`, `sinkhorn` and `h_aggregate` give them.
    """
    spec = get_variant(variant)
    n, iterations = check_pre_args(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, spec,
                                   norm_eps=norm_eps)
    h_pre, h_post, logits = mapping(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, spec, norm_eps)
    h_res = sinkhorn(logits, iterations, None, spec)
    aggregate = h_aggregate(x.reshape(x.shape[0], n, x.shape[1] // n), h_pre)
    return aggregate, h_pre, h_post, h_res
