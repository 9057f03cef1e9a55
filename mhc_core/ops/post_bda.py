"""Residual mix + expanded branch + bias-dropout-add.

`h_post_bda(h_res[T, n, n], residual[T, n, C], h_post[T, n], y[T, C], bias[C] | None,
            dropout_p, training, variant) -> [T, n, C]`

    mix_i    = sum_j H[i, j] * residual_j     (paper, megatron_main: H @ x)
    mix_i    = sum_j H[j, i] * residual_j     (megatron_dev: H^T @ x)
    out      = mix + dropout(h_post_i * (y + bias), p)     dropout on the expanded [T, n, C] branch,
                                                          as Megatron's bias-dropout-add does
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from mhc_core.checks import check_dim, check_floating, check_number, check_rank, check_streams
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = [
    "PostBdaBackend",
    "PostBdaCall",
    "h_post_bda",
    "h_post_bda_reference",
    "apply_h_res",
    "check_h_post_bda_args",
]


def check_h_post_bda_args(h_res, residual, h_post, y, bias, dropout_p, *, op: str = "h_post_bda") -> None:
    """The argument checks of `h_post_bda`, shared by every backend: `ValueError` naming the argument."""
    check_rank(residual, 3, name="residual", op=op, layout="[T, n, C]")
    t, n, c = residual.shape
    check_dim(h_res, (t, n, n), name="h_res", op=op, layout="[T, n, n]")
    check_dim(h_post, (t, n), name="h_post", op=op, layout="[T, n]")
    check_dim(y, (t, c), name="y", op=op, layout="[T, C]")
    if bias is not None:
        check_dim(bias, (c,), name="bias", op=op, layout="[C]")
    check_streams(n, op=op)
    check_number(dropout_p, name="dropout_p", op=op, low=0.0, high=1.0)
    check_floating(op=op, h_res=h_res, residual=residual, h_post=h_post, y=y, bias=bias)


def apply_h_res(h_res: torch.Tensor, residual: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`[T, n, n] x [T, n, C] -> [T, n, C]`, `H @ x` or `H^T @ x`, accumulated in fp32 at least."""
    acc = torch.promote_types(torch.promote_types(residual.dtype, h_res.dtype), torch.float32)
    eq = "tji,tjc->tic" if transposed else "tij,tjc->tic"
    return torch.einsum(eq, h_res.to(acc), residual.to(acc))


@dataclass(frozen=True, kw_only=True)
class PostBdaCall:
    """A checked `h_post_bda` call, what every backend's `h_post_bda` receives (built by `h_post_bda`)."""

    h_res: torch.Tensor
    """`[T, n, n]` residual mixing matrix."""
    residual: torch.Tensor
    """`[T, n, C]` the sublayer's input streams."""
    h_post: torch.Tensor
    """`[T, n]` output gates."""
    y: torch.Tensor
    """`[T, C]` the sublayer's output (without its bias)."""
    bias: torch.Tensor | None
    """`[C]` or None."""
    dropout_p: float
    training: bool
    spec: VariantSpec


class PostBdaBackend(Protocol):
    """A backend's `h_post_bda` (`contract.Backend`)."""

    def h_post_bda(self, call: PostBdaCall) -> torch.Tensor: ...


def h_post_bda_reference(call: PostBdaCall) -> torch.Tensor:
    """The reference backend's `h_post_bda` (the module docstring's math)."""
    mix = apply_h_res(call.h_res, call.residual, call.spec.res_transposed)
    acc = mix.dtype
    y, bias = call.y, call.bias
    branch_in = y.to(acc) if bias is None else y.to(acc) + bias.to(acc)
    branch = call.h_post.to(acc).unsqueeze(-1) * branch_in.unsqueeze(-2)  # [T, n, C]
    if call.training and call.dropout_p > 0:
        branch = F.dropout(branch, p=call.dropout_p, training=True)
    return (mix + branch).to(call.residual.dtype)


def h_post_bda(
    h_res: torch.Tensor,
    residual: torch.Tensor,
    h_post: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    dropout_p: float = 0.0,
    training: bool = False,
    variant: str | Variant | VariantSpec = Variant.MEGATRON_MAIN,
    *,
    backend: PostBdaBackend | None = None,
) -> torch.Tensor:
    """New `n`-stream residual after one sublayer.

    Args:
        h_res: `[T, n, n]` residual mixing matrix.
        residual: `[T, n, C]` the sublayer's input streams.
        h_post: `[T, n]` output gates.
        y: `[T, C]` the sublayer's output (without its bias).
        bias: `[C]` or None, the sublayer's output bias.
        dropout_p: hidden dropout probability, applied to the expanded branch when `training`.
        backend: the backend that computes it (`mhc_core.kernels`); None: the reference.

    Returns:
        `[T, n, C]` in `residual.dtype`.
    """
    spec = get_variant(variant)
    check_h_post_bda_args(h_res, residual, h_post, y, bias, dropout_p, op="h_post_bda")
    call = PostBdaCall(
        h_res=h_res,
        residual=residual,
        h_post=h_post,
        y=y,
        bias=bias,
        dropout_p=float(dropout_p),
        training=bool(training),
        spec=spec,
    )
    return h_post_bda_reference(call) if backend is None else backend.h_post_bda(call)
