"""The single-pass pre-op (DeepSeek-V4.1) and the mixes at its entry and exit.

`single_pass_pre(x[T, n*C], previous_h_pre[T, n] | None, weight[N, n*C], alpha_pre, alpha_post, alpha_res,
                 bias[N], n, iterations, variant, norm_eps, *, backend)
 -> aggregate[T, C], next_h_pre[T, n], h_post[T, n], h_res[T, n, n]`

It is `pre`'s call in the single-pass form (`PreCall(form=single_pass, previous_h_pre=...)`): every backend's
`pre` computes it, the fused ones from one read of the streams for the projection, the RMS factor and the
aggregate with the previous `H_pre`.

Sublayer `k` of the single-pass form (`mhc_core.forms`) computes, from its input streams `x_k`:

    h_pre_{k+1}, h_post_k, logits_k = mapping(x_k)        the variant's mapping (projection, RMS, gates)
    h_res_k                         = sinkhorn(logits_k)
    aggregate_k                     = sum_i h_pre_k[i] * x_k[i]      with the H_pre sublayer k - 1 produced
    x_{k+1} = h_post_bda(h_res_k, x_k, h_post_k, F_k(aggregate_k))   as in the per-sublayer form

The model's first sublayer has no predecessor: `previous_h_pre=None` reads stream 0 (`entry_mix`, the identity
mix: exactly `x_k[0]`, its gradient reaching stream 0 only). The exit aggregates the last streams with the last
sublayer's `H_pre` (`exit_aggregate`). The `H_pre` handed on keeps the dtype the mapping gives it (`mix_dtype`:
fp32 under `fp32_coefficients`, the activation dtype under `activation_coefficients`); the aggregate accumulates
in fp32 at least and rounds once to `x.dtype`.
"""

from __future__ import annotations

import torch

from mhc_core.checks import check_dim, check_floating, check_rank, check_streams, shape_str
from mhc_core.forms import ConnectionForm
from mhc_core.ops.aggregate import h_aggregate
from mhc_core.ops.mapping import NORM_EPS, compute_dtype
from mhc_core.ops.pre import PreBackend, PreCall, check_pre_args, pre_reference
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = ["check_previous_h_pre", "entry_mix", "exit_aggregate", "mix_dtype", "single_pass_pre"]


def mix_dtype(variant: str | Variant | VariantSpec, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the `H_pre` a sublayer hands on for `dtype` streams: the mapping's compute dtype when the
    coefficients stay there (`fp32_coefficients`), else `dtype`."""
    spec = get_variant(variant)
    return dtype if spec.coefficients_in_activation_dtype else compute_dtype(spec, dtype)


def entry_mix(
    tokens: int | tuple[int, ...],
    n: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The identity mix of the model's first sublayer: `[*tokens, n]`, 1 on stream 0 and 0 elsewhere (an
    aggregate with it is exactly stream 0)."""
    n = check_streams(n, op="entry_mix")
    shape = (tokens,) if isinstance(tokens, int) else tuple(tokens)
    out = torch.zeros(*shape, n, dtype=dtype, device=device)
    out[..., 0] = 1
    return out


def check_previous_h_pre(
    previous_h_pre: torch.Tensor | None,
    tokens: tuple[int, ...],
    n: int,
    *,
    op: str,
    name: str = "previous_h_pre",
    layout: str = "[T, n]",
) -> None:
    """`previous_h_pre` is None (the model's entry) or a floating tensor `[*tokens, n]`; a `ValueError` names it
    (`name`)."""
    if previous_h_pre is None:
        return
    check_rank(previous_h_pre, len(tokens) + 1, name=name, op=op, layout=layout)
    check_dim(previous_h_pre, (*tokens, n), name=name, op=op, layout=layout)
    check_floating(op=op, **{name: previous_h_pre})


def single_pass_pre(
    x: torch.Tensor,
    previous_h_pre: torch.Tensor | None,
    weight: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    iterations: int = 20,
    variant: str | Variant | VariantSpec = Variant.MEGATRON_DEV,
    norm_eps: float = NORM_EPS,
    *,
    backend: PreBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients and aggregated input of one single-pass sublayer for `T` tokens.

    Args:
        x: `[T, n*C]` flattened streams (stream-major); weight `[N, n*C]`; alphas `[1]`; bias `[N]`.
        previous_h_pre: `[T, n]`, the `H_pre` the previous sublayer produced; None at the model's entry
            (stream 0).
        n: residual streams; iterations: Sinkhorn iterations (>= 1).
        backend: the backend whose `pre` computes it (`mhc_core.kernels`); None: the reference.

    Returns:
        `aggregate [T, C]` (in `x.dtype`), `next_h_pre [T, n]` (the next sublayer's), `h_post [T, n]`,
        `h_res [T, n, n]` (after Sinkhorn).
    """
    op = "single_pass_pre"
    spec = get_variant(variant)
    n, iterations = check_pre_args(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, spec, op=op, norm_eps=norm_eps
    )
    check_previous_h_pre(previous_h_pre, (x.shape[0],), n, op=op)
    call = PreCall(
        x=x,
        weight=weight,
        alpha_pre=alpha_pre,
        alpha_post=alpha_post,
        alpha_res=alpha_res,
        bias=bias,
        n=n,
        iterations=iterations,
        spec=spec,
        norm_eps=float(norm_eps),
        form=ConnectionForm.SINGLE_PASS,
        previous_h_pre=previous_h_pre,
    )
    return pre_reference(call) if backend is None else backend.pre(call)


def exit_aggregate(x: torch.Tensor, last_h_pre: torch.Tensor, n: int) -> torch.Tensor:
    """The single-pass exit: `[s, b, n*C]` streams aggregated with the last sublayer's `H_pre [s, b, n]` into
    `[s, b, C]` (fp32 accumulation, one rounding to `x.dtype`)."""
    op = "exit_aggregate"
    n = check_streams(n, op=op)
    check_rank(x, 3, name="x", op=op, layout="[s, b, n*C]")
    if x.shape[-1] % n != 0 or x.shape[-1] == 0:
        raise ValueError(
            f"{op}: hidden width {x.shape[-1]} of x {shape_str(x)} is not a positive multiple of n={n}"
        )
    s, b, width = x.shape
    if last_h_pre is None:
        raise ValueError(
            f"{op}: last_h_pre is None; the exit aggregates with the last sublayer's H_pre [s, b, n]"
        )
    check_previous_h_pre(last_h_pre, (s, b), n, op=op, name="last_h_pre", layout="[s, b, n]")
    out = h_aggregate(x.reshape(s * b, n, width // n), last_h_pre.reshape(s * b, n))
    return out.view(s, b, width // n)
