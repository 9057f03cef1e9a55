"""`mhc_core` as a peer: every variant, on the reference or the compiled backend.

The baseline the other peers are read against: each variant must match its own oracle on every
check (the oracle is the reference backend in fp64; the compiled backend runs in the peer's dtype).
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass
from typing import Any

import torch

from harness.peers.base import Head, Peer, Sublayer, SublayerParams
from mhc_core.ops.mapping import NORM_EPS

__all__ = ["BLOCK_EXIT_EPS", "MhcCorePeer", "mhc_core_peers", "sublayer"]

BLOCK_EXIT_EPS = 1e-6
"""eps of the learned contraction in the checks: DeepSeek-V4's `rms_norm_eps` and `hc_eps` (both 1e-6);
upstream dev passes `layernorm_epsilon`."""


def sublayer(
    x: torch.Tensor, sub: Sublayer, iterations: int, variant: str, ops: Any = None, norm_eps: float = NORM_EPS
) -> torch.Tensor:
    """`x [T, n, C] -> [T, n, C]`: one mHC sublayer around `sub.f` with `mhc_core`'s ops (or `ops`,
    an object with `mapping`, `sinkhorn`, `h_aggregate` and `h_post_bda`; `norm_eps`: the mapping's)."""
    import mhc_core.ops as ref

    o = ops or ref
    p, (t, n, c) = sub.params, x.shape
    h_pre, h_post, logits = o.mapping(
        x.reshape(t, n * c),
        p.weight,
        p.alpha_pre,
        p.alpha_post,
        p.alpha_res,
        p.bias,
        n,
        variant=variant,
        norm_eps=norm_eps,
    )
    h_res = o.sinkhorn(logits, iterations, variant=variant)
    y = sub.f(o.h_aggregate(x, h_pre))
    return o.h_post_bda(h_res, x, h_post, y, None, variant=variant)


@dataclass(frozen=True, kw_only=True)
class MhcCorePeer(Peer):
    """One variant (or configuration, `megatron_dev+learned_exit`) of `mhc_core` on one backend
    (`reference` or `compiled`)."""

    variant: str
    backend: str = "reference"
    norm_eps: float = NORM_EPS
    """The mapping's RMS eps (an oracle standing for a dtype's machine eps sets it)."""

    def version(self) -> str | None:
        try:
            return md.version("mhc-core")
        except md.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        from mhc_core.kernels import dispatch

        ok, why = dispatch.availability(self.backend, "cpu" if self.backend != "cutile" else "cuda")
        return None if ok else f"mhc_core backend {self.backend!r} unavailable here: {why}"

    def _ops(self):
        """The public op entries on this peer's backend."""
        from mhc_core.kernels.dispatch import bound_ops

        return bound_ops(self.backend)

    def coefficients(self, x, params: SublayerParams, iterations):
        o = self._ops()
        t, n, c = x.shape
        p = params
        h_pre, h_post, logits = o.mapping(
            x.reshape(t, n * c),
            p.weight,
            p.alpha_pre,
            p.alpha_post,
            p.alpha_res,
            p.bias,
            n,
            variant=self.variant,
            norm_eps=self.norm_eps,
        )
        h_res = o.sinkhorn(logits, iterations, variant=self.variant)
        return {"h_pre": h_pre, "h_post": h_post, "h_res": h_res, "aggregate": o.h_aggregate(x, h_pre)}

    def aggregate(self, x, h_pre):
        return self._ops().h_aggregate(x, h_pre)

    def single_pass(self, x, previous_h_pre, params: SublayerParams, iterations):
        t, n, c = x.shape
        p = params
        aggregate, next_h_pre, h_post, h_res = self._ops().single_pass_pre(
            x.reshape(t, n * c),
            previous_h_pre,
            p.weight,
            p.alpha_pre,
            p.alpha_post,
            p.alpha_res,
            p.bias,
            n,
            iterations,
            variant=self.variant,
            norm_eps=self.norm_eps,
        )
        return {"aggregate": aggregate, "next_h_pre": next_h_pre, "h_post": h_post, "h_res": h_res}

    def mix(self, h_res, residual, h_post, y):
        return self._ops().h_post_bda(h_res, residual, h_post, y, None, variant=self.variant)

    def sinkhorn(self, logits, iterations):
        return self._ops().sinkhorn(logits, iterations, variant=self.variant)

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        o = self._ops()
        e = self.norm_eps
        return sublayer(
            sublayer(x, attn, iterations, self.variant, o, e), mlp, iterations, self.variant, o, e
        )

    def block_exit(self, x, head_fn, head_base, head_scale):
        """The configuration's exit: the learned contraction, or the mean of the streams (the head unused)."""
        from mhc_core.ops import contract, learned_contract
        from mhc_core.variants import OutputContraction, get_variant

        t, n, c = x.shape
        if get_variant(self.variant).output_contraction == OutputContraction.MEAN:
            return contract(x.reshape(1, t, n * c), n)[0]
        return learned_contract(
            x.reshape(1, t, n * c), head_fn, head_base, head_scale, n, eps=BLOCK_EXIT_EPS
        )[0]

    def stack(self, h, layers, head: Head, iterations):
        """`h [T, C] -> [T, C]`: `expand` to n streams, `layer` per layer, `block_exit`."""
        from mhc_core.ops import expand

        t, c = h.shape
        n = layers[0][0].params.n
        x = expand(h.unsqueeze(0), n).reshape(t, n, c)
        for attn, mlp in layers:
            x = self.layer(x, attn, mlp, iterations)
        return self.block_exit(x, head.fn, head.base, head.scale)


def mhc_core_peers(backends: tuple[str, ...] = ("reference",)) -> list[MhcCorePeer]:
    """`mhc_core[<variant>]` (reference backend) and `mhc_core[<variant>,<backend>]` for the others."""
    from mhc_core.variants import Variant

    out = []
    for backend in backends:
        for v in Variant:
            tag = v.value if backend == "reference" else f"{v.value},{backend}"
            out.append(
                MhcCorePeer(
                    name=f"mhc_core[{tag}]",
                    variant=v.value,
                    backend=backend,
                    claims=v.value,
                    description=f"mhc_core's {v.value} variant, {backend} backend",
                    ops=frozenset(
                        {"coefficients", "aggregate", "mix", "sinkhorn", "layer", "block_exit", "stack"}
                    ),
                )
            )
    return out


def single_pass_peer(backend: str = "reference") -> MhcCorePeer:
    """`mhc_core[deepseek_v41]`: DeepSeek-V4.1's numerics with the single-pass op (`single_pass_pre`) beside the
    per-sublayer ones, the row the single-pass implementations are read against."""
    tag = "deepseek_v41" if backend == "reference" else f"deepseek_v41,{backend}"
    return MhcCorePeer(
        name=f"mhc_core[{tag}]",
        variant="deepseek_v41",
        backend=backend,
        claims="megatron_dev+eps_inside_sqrt",
        description=f"mhc_core's DeepSeek-V4.1 numerics (deepseek_v41), single-pass op, {backend} backend",
        ops=frozenset({"coefficients", "aggregate", "mix", "sinkhorn", "single_pass"}),
    )
