"""The mHC coefficient mapping: projection, RMS scaling, gates.

`mapping(x[T, n*C], weight[N, n*C], alpha_pre, alpha_post, alpha_res, bias[N], n, variant)
 -> h_pre[T, n], h_post[T, n], h_res_logits[T, n, n]`, with N = n*n + 2n.

    r     = 1 / (||x||_2 / sqrt(n*C) + norm_eps)        RMS over all n*C, eps outside the sqrt
          = rsqrt(||x||_2^2 / (n*C) + norm_eps)         with the option `eps_inside_sqrt`
          = rsqrt(||x||_2^2 / (n*C) + finfo(compute).eps)   with `dtype_eps_inside_sqrt` (`effective_norm_eps`)
    h     = r * (x @ weight^T) * alpha + bias           RMS applied after the projection
    alpha = [alpha_pre x n | alpha_post x n | alpha_res x n*n]
    h_pre = sigmoid(h[:, :n]) (+ 1e-6 in megatron_dev), h_post = 2 * sigmoid(h[:, n:2n]),
    h_res_logits = h[:, 2n:].view(T, n, n)              row-major

Precision per variant: `megatron_main` computes in the activation dtype (parameters cast to it);
`paper` and `megatron_dev` upcast to fp32 (the option `fp32_mappings` / `activation_mappings` swaps). Outputs are in the activation dtype for the two
Megatron variants and fp32 for `paper` (the paper keeps every coefficient in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from mhc_core.checks import check_dim, check_floating, check_number, check_rank, check_streams, shape_str
from mhc_core.ops.permutations import num_permutations, permutation_mixture
from mhc_core.variants import ResidualConstraint, Variant, VariantSpec, get_variant

__all__ = [
    "MappingBackend",
    "MappingCall",
    "mapping_reference",
    "mapping",
    "gated_projection",
    "permutation_mapping",
    "num_mapping_outputs",
    "num_res_logits",
    "check_mapping_args",
    "compute_dtype",
    "effective_norm_eps",
    "NORM_EPS",
]

NORM_EPS = 1e-6
"""eps of the RMS norm (outside the square root, as upstream, unless the spec says inside)."""


def compute_dtype(spec: VariantSpec, dtype: torch.dtype) -> torch.dtype:
    """The dtype the mapping computes in for `dtype` inputs: fp32 at least under fp32 mappings, else `dtype`."""
    return torch.promote_types(dtype, torch.float32) if spec.mapping_fp32 else dtype


def effective_norm_eps(spec: VariantSpec, norm_eps: float, compute: torch.dtype) -> float:
    """The eps the RMS norm adds: `norm_eps`, or under `dtype_eps_inside_sqrt` the machine eps of `compute`, the
    dtype the mapping computes in (every backend resolves it here)."""
    return float(torch.finfo(compute).eps) if spec.norm_eps_from_dtype else norm_eps


def num_res_logits(n: int, residual: ResidualConstraint = ResidualConstraint.SINKHORN) -> int:
    """The residual logits per token: n*n, or n! for the permutation mixture (mHC-lite)."""
    if residual == ResidualConstraint.PERMUTATIONS:
        return num_permutations(n)
    return n * n


def num_mapping_outputs(n: int, residual: ResidualConstraint = ResidualConstraint.SINKHORN) -> int:
    """N = n*n + 2n, the width of the projection (2n + n! for the permutation mixture)."""
    return num_res_logits(n, residual) + 2 * n


def check_mapping_args(
    x,
    weight,
    alpha_pre,
    alpha_post,
    alpha_res,
    bias,
    n,
    *,
    op: str = "mapping",
    norm_eps: float = NORM_EPS,
    residual: ResidualConstraint = ResidualConstraint.SINKHORN,
) -> int:
    """The argument checks of `mapping`, shared by every backend; returns `n` as a Python int."""
    n = check_streams(n, op=op)
    check_number(norm_eps, name="norm_eps", op=op, low=0.0)
    check_rank(x, 2, name="x", op=op, layout="[T, n*C]")
    width = x.shape[1]
    if width % n != 0 or width == 0:
        raise ValueError(
            f"{op}: x width n*C={width} is not a positive multiple of n={n}; x is {shape_str(x)}"
        )
    big_n = num_mapping_outputs(n, residual)
    check_dim(weight, (big_n, width), name="weight", op=op, layout="[N, n*C]")
    for name, a in (("alpha_pre", alpha_pre), ("alpha_post", alpha_post), ("alpha_res", alpha_res)):
        check_dim(a, (1,), name=name, op=op, layout="[1]")
    check_dim(bias, (big_n,), name="bias", op=op, layout="[N]")
    check_floating(
        op=op, x=x, weight=weight, alpha_pre=alpha_pre, alpha_post=alpha_post, alpha_res=alpha_res, bias=bias
    )
    return n


@dataclass(frozen=True, kw_only=True)
class MappingCall:
    """A checked `mapping` call, what every backend's `mapping` receives (built by `mapping`)."""

    x: torch.Tensor
    """`[T, n*C]` flattened streams (stream-major)."""
    weight: torch.Tensor
    """`[N, n*C]`, N = n*n + 2n, layout `[pre(n) | post(n) | res(n*n)]`."""
    alpha_pre: torch.Tensor
    """`[1]`."""
    alpha_post: torch.Tensor
    """`[1]`."""
    alpha_res: torch.Tensor
    """`[1]`."""
    bias: torch.Tensor
    """`[N]`."""
    n: int
    spec: VariantSpec
    norm_eps: float

    @property
    def params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(weight, alpha_pre, alpha_post, alpha_res, bias)`."""
        return self.weight, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias


class MappingBackend(Protocol):
    """A backend's `mapping` (`contract.Backend`)."""

    def mapping(self, call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def mapping_reference(call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference backend's `mapping` (the module docstring's math)."""
    h_pre, h_post, logits = gated_projection(
        call.x, *call.params, call.n, call.spec, call.norm_eps, ResidualConstraint.SINKHORN, op="mapping"
    )
    return h_pre, h_post, logits.reshape(call.x.shape[0], call.n, call.n)


def mapping(
    x: torch.Tensor,
    weight: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    variant: str | Variant | VariantSpec = Variant.MEGATRON_MAIN,
    norm_eps: float = NORM_EPS,
    *,
    backend: MappingBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one mHC sublayer for `T` tokens.

    Args:
        x: `[T, n*C]` flattened streams (stream-major).
        weight: `[N, n*C]`, N = n*n + 2n, layout `[pre(n) | post(n) | res(n*n)]`.
        alpha_pre, alpha_post, alpha_res: `[1]` gating scalars.
        bias: `[N]`.
        n: residual streams.
        backend: the backend that computes it (`mhc_core.kernels`); None: the reference.

    Returns:
        `h_pre [T, n]`, `h_post [T, n]`, `h_res_logits [T, n, n]`.
    """
    spec = get_variant(variant)
    n = check_mapping_args(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, op="mapping", norm_eps=norm_eps
    )
    call = MappingCall(
        x=x,
        weight=weight,
        alpha_pre=alpha_pre,
        alpha_post=alpha_post,
        alpha_res=alpha_res,
        bias=bias,
        n=n,
        spec=spec,
        norm_eps=float(norm_eps),
    )
    return mapping_reference(call) if backend is None else backend.mapping(call)


def gated_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    variant: str | Variant | VariantSpec,
    norm_eps: float,
    residual: ResidualConstraint | str,
    *,
    op: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mapping`'s math for any residual constraint: `h_pre [T, n]`, `h_post [T, n]` and the residual logits flat,
    `[T, n*n]`, or `[T, n!]` for `permutations` (whose weight and bias have `2n + n!` rows: mHC-lite)."""
    spec = get_variant(variant)
    residual = ResidualConstraint(residual)
    n = check_mapping_args(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, op=op, norm_eps=norm_eps, residual=residual
    )
    n_res = num_res_logits(n, residual)
    width = x.shape[1]

    compute = compute_dtype(spec, x.dtype)
    norm_eps = effective_norm_eps(spec, norm_eps, compute)
    xc = x.to(compute)
    proj = xc @ weight.to(compute).t()  # [T, N]
    if spec.norm_eps_inside:
        r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + norm_eps)  # [T, 1]
    else:
        rms = torch.linalg.vector_norm(xc, dim=-1, keepdim=True) / math.sqrt(width)
        r = 1.0 / (rms + norm_eps)  # [T, 1]
    alpha = torch.cat(
        [
            alpha_pre.to(compute).expand(n),
            alpha_post.to(compute).expand(n),
            alpha_res.to(compute).expand(n_res),
        ]
    )
    h = r * proj * alpha + bias.to(compute)
    h_pre = torch.sigmoid(h[:, :n])
    if spec.h_pre_eps:
        h_pre = h_pre + spec.h_pre_eps
    h_post = 2.0 * torch.sigmoid(h[:, n : 2 * n])
    h_res_logits = h[:, 2 * n :]
    if spec.coefficients_in_activation_dtype:
        h_pre, h_post, h_res_logits = (t.to(x.dtype) for t in (h_pre, h_post, h_res_logits))
    return h_pre, h_post, h_res_logits


def permutation_mapping(
    x: torch.Tensor,
    weight: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    variant: str | Variant | VariantSpec = Variant.MEGATRON_DEV,
    norm_eps: float = NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC-lite's coefficients (`ResidualConstraint.PERMUTATIONS`): `mapping` with `2n + n!` projection outputs
    (`weight [2n + n!, n*C]`, `bias` likewise): `h_pre [T, n]`, `h_post [T, n]`, and `h_res [T, n, n]`, the
    permutation mixture of the `n!` logits (`mhc_core.ops.permutations`)."""
    h_pre, h_post, logits = gated_projection(
        x,
        weight,
        alpha_pre,
        alpha_post,
        alpha_res,
        bias,
        n,
        variant,
        norm_eps,
        ResidualConstraint.PERMUTATIONS,
        op="permutation_mapping",
    )
    return h_pre, h_post, permutation_mixture(logits, n)
