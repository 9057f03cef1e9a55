"""The pre-op of one mHC sublayer: mapping, Sinkhorn and the aggregate of the streams in one call.

`pre(x[T, n*C], weight[N, n*C], alpha_pre, alpha_post, alpha_res, bias[N], n, iterations, variant)
 -> aggregate[T, C], h_pre[T, n], h_post[T, n], h_res[T, n, n]`

What every sublayer does before its function: the coefficients from the RMS-normalised streams
(`mapping`), the Sinkhorn projection of the residual logits (`sinkhorn`) and the weighted sum of the
streams that is the sublayer's input (`h_aggregate`). This reference is exactly that composition, the
oracle of the fused backends, which read `x` once per pass instead of once per op and produce one
gradient of `x` (`docs/kernels.md`, "The fused pre-op").

The same call serves the single-pass form (`mhc_core.forms`, `ops.single_pass_pre` builds it): the branch input
then aggregates with the `H_pre` of the previous sublayer (`PreCall.previous_h_pre`; stream 0 at the model's
entry) and the `h_pre` returned is the next sublayer's (`PreCall.branch_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mhc_core.forms import ConnectionForm
from mhc_core.ops.aggregate import AggregateCall, h_aggregate_reference
from mhc_core.ops.mapping import NORM_EPS, MappingCall, check_mapping_args, mapping_reference
from mhc_core.ops.sinkhorn import SinkhornCall, check_sinkhorn_args, sinkhorn_reference
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = ["PreBackend", "PreCall", "branch_reference", "check_pre_args", "pre", "pre_reference"]


def check_pre_args(
    x,
    weight,
    alpha_pre,
    alpha_post,
    alpha_res,
    bias,
    n,
    iterations,
    spec: VariantSpec,
    *,
    op: str = "pre",
    norm_eps: float = NORM_EPS,
) -> tuple[int, int]:
    """The argument checks of `pre`, shared by every backend (those of `mapping` and the iteration count of
    `sinkhorn`); returns `(n, iterations)` as Python ints."""
    n = check_mapping_args(x, weight, alpha_pre, alpha_post, alpha_res, bias, n, op=op, norm_eps=norm_eps)
    iterations, _ = check_sinkhorn_args(weight.new_empty(0, n, n), iterations, None, spec, op=op)
    return n, iterations


@dataclass(frozen=True, kw_only=True)
class PreCall:
    """A checked `pre` call, what every backend's `pre` receives (built by `pre`); the calls of the three ops it
    composes are `mapping_call`, `sinkhorn_call` and `aggregate_call`."""

    x: torch.Tensor
    """`[T, n*C]` flattened streams (stream-major)."""
    weight: torch.Tensor
    """`[N, n*C]`."""
    alpha_pre: torch.Tensor
    alpha_post: torch.Tensor
    alpha_res: torch.Tensor
    bias: torch.Tensor
    """`[N]`."""
    n: int
    iterations: int
    spec: VariantSpec
    norm_eps: float
    form: ConnectionForm = ConnectionForm.PER_SUBLAYER
    """`single_pass`: the branch input aggregates with `previous_h_pre`, not with this call's own `h_pre`."""
    previous_h_pre: torch.Tensor | None = None
    """Single-pass only: `[T, n]`, the `H_pre` the previous sublayer produced; None at the model's entry (the
    identity mix: the branch input is exactly stream 0)."""

    @property
    def single_pass(self) -> bool:
        """Whether the call is the single-pass form's (`form`)."""
        return self.form == ConnectionForm.SINGLE_PASS

    def branch_weights(self, h_pre: torch.Tensor) -> torch.Tensor | None:
        """The weights `[T, n]` the branch input aggregates the streams with: this call's own `h_pre`
        (per-sublayer), the previous sublayer's (single-pass), or None (single-pass entry: stream 0)."""
        return self.previous_h_pre if self.single_pass else h_pre

    def streams(self) -> torch.Tensor:
        """`x` viewed `[T, n, C]`."""
        return self.x.reshape(self.x.shape[0], self.n, self.x.shape[1] // self.n)

    @property
    def params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(weight, alpha_pre, alpha_post, alpha_res, bias)`."""
        return self.weight, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias

    def mapping_call(self) -> MappingCall:
        """The `mapping` it starts with."""
        return MappingCall(
            x=self.x,
            weight=self.weight,
            alpha_pre=self.alpha_pre,
            alpha_post=self.alpha_post,
            alpha_res=self.alpha_res,
            bias=self.bias,
            n=self.n,
            spec=self.spec,
            norm_eps=self.norm_eps,
        )

    def sinkhorn_call(self, logits: torch.Tensor) -> SinkhornCall:
        """The `sinkhorn` of the mapping's residual logits `[T, n, n]`."""
        return SinkhornCall(
            logits=logits, iterations=self.iterations, eps=self.spec.sinkhorn_eps, spec=self.spec
        )

    def aggregate_call(self, h_pre: torch.Tensor) -> AggregateCall:
        """The `h_aggregate` of the streams `[T, n, C]` with `h_pre [T, n]`."""
        return AggregateCall(x=self.streams(), h_pre=h_pre)


class PreBackend(Protocol):
    """A backend's `pre` (`contract.Backend`)."""

    def pre(self, call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


def branch_reference(call: PreCall, h_pre: torch.Tensor) -> torch.Tensor:
    """The branch input `[T, C]` of `call` given its own `h_pre [T, n]` (`PreCall.branch_weights`): the reference
    aggregate, or stream 0 (a copy) at the single-pass entry."""
    weights = call.branch_weights(h_pre)
    if weights is None:
        return call.streams()[:, 0, :].clone()
    return h_aggregate_reference(call.aggregate_call(weights))


def pre_reference(call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference backend's `pre`: exactly `mapping`, `sinkhorn` and `h_aggregate` in a row (the aggregate with
    the previous `H_pre` in the single-pass form)."""
    h_pre, h_post, logits = mapping_reference(call.mapping_call())
    h_res = sinkhorn_reference(call.sinkhorn_call(logits))
    return branch_reference(call, h_pre), h_pre, h_post, h_res


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
    *,
    backend: PreBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients and aggregated input of one mHC sublayer for `T` tokens.

    Args:
        x: `[T, n*C]` flattened streams (stream-major); weight `[N, n*C]`; alphas `[1]`; bias `[N]`.
        n: residual streams; iterations: Sinkhorn iterations (>= 1).
        backend: the backend that computes it (`mhc_core.kernels`); None: the reference.

    Returns:
        `aggregate [T, C]` (in `x.dtype`), `h_pre [T, n]`, `h_post [T, n]`, `h_res [T, n, n]` (after
        Sinkhorn), each as `mapping`, `sinkhorn` and `h_aggregate` give them.
    """
    spec = get_variant(variant)
    n, iterations = check_pre_args(
        x, weight, alpha_pre, alpha_post, alpha_res, bias, n, iterations, spec, norm_eps=norm_eps
    )
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
    )
    return pre_reference(call) if backend is None else backend.pre(call)
