"""Seeded faulty implementations, through the same adapter interface as every peer.

Each is `mhc_core` with one fault of the kind users of mHC implementations have met (upstream's
transposed H_res, #4957 / #4839; Sinkhorn variants misaligned, #5106 / #4624; the transpose in NeMo's
DeepSeek-V4 port), and names the checks that must catch it and checks it must leave passing.
`test_mutants.py` runs the matrix on each.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

import mhc_core.ops as ops
from harness.peers.base import SublayerParams
from harness.peers.mhc_core_peer import MhcCorePeer, mhc_core_peers, sublayer
from mhc_core.ops.mapping import NORM_EPS
from mhc_core.variants import get_variant

__all__ = ["MUTANTS", "Mutant"]

_ALL_OPS = mhc_core_peers()[0].ops


@dataclass(frozen=True, kw_only=True)
class Mutant(MhcCorePeer):
    """`mhc_core[variant]` with one fault; `caught_by` / `spared` are check-id prefixes that must
    fail / still pass against that variant."""

    fault: str
    caught_by: tuple[str, ...]
    spared: tuple[str, ...] = ()

    def _mapping(self, flat, w, a_pre, a_post, a_res, bias, n, variant=None, norm_eps=NORM_EPS):
        """`[T, n*C] -> h_pre, h_post, logits` with the mapping faults."""
        if self.fault == "bias pre/post halves swapped":
            bias = torch.cat([bias[n : 2 * n], bias[:n], bias[2 * n :]])
        if self.fault == "norm eps inside the square root":
            spec = get_variant(self.variant)
            r = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
            alpha = torch.cat([a_pre.expand(n), a_post.expand(n), a_res.expand(n * n)])
            h = r * (flat @ w.t()) * alpha + bias
            return (
                torch.sigmoid(h[:, :n]) + spec.h_pre_eps,
                2 * torch.sigmoid(h[:, n : 2 * n]),
                h[:, 2 * n :].reshape(-1, n, n),
            )
        h_pre, h_post, logits = ops.mapping(
            flat, w, a_pre, a_post, a_res, bias, n, variant=self.variant, norm_eps=norm_eps
        )
        if self.fault == "H_post without its factor 2":
            h_post = h_post / 2
        return h_pre, h_post, logits

    def _sinkhorn(self, logits, iterations, variant=None):
        if self.fault == "gradient detached before Sinkhorn":
            logits = logits.detach()
        out = ops.sinkhorn(logits, iterations, variant=self.variant)
        if self.fault == "Sinkhorn ends on a row pass":
            out = out / out.sum(-1, keepdim=True)
        return out

    def _h_post_bda(self, h_res, residual, h_post, y, bias, variant=None):
        untransposed = self.fault == "residual mix untransposed"
        return ops.h_post_bda(
            h_res, residual, h_post, y, bias, variant="megatron_main" if untransposed else self.variant
        )

    def _ops(self):
        return SimpleNamespace(
            mapping=self._mapping,
            sinkhorn=self._sinkhorn,
            h_aggregate=ops.h_aggregate,
            h_post_bda=self._h_post_bda,
            single_pass_pre=ops.single_pass_pre,
        )

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        p = params
        h_pre, h_post, logits = self._mapping(
            x.reshape(t, n * c), p.weight, p.alpha_pre, p.alpha_post, p.alpha_res, p.bias, n
        )
        return {
            "h_pre": h_pre,
            "h_post": h_post,
            "h_res": self._sinkhorn(logits, iterations),
            "aggregate": ops.h_aggregate(x, h_pre),
        }

    def mix(self, h_res, residual, h_post, y):
        return self._h_post_bda(h_res, residual, h_post, y, None)

    def sinkhorn(self, logits, iterations):
        return self._sinkhorn(logits, iterations)

    def layer(self, x, attn, mlp, iterations):
        o = self._ops()
        return sublayer(sublayer(x, attn, iterations, self.variant, o), mlp, iterations, self.variant, o)

    def single_pass(self, x, previous_h_pre, params: SublayerParams, iterations):
        if self.fault == "single-pass aggregate with its own H_pre":  # V4's reading in a V4.1 model
            own = super().single_pass(x, None, params, iterations)
            out = super().single_pass(x, own["next_h_pre"], params, iterations)
            return {**out, "next_h_pre": own["next_h_pre"]}
        out = super().single_pass(x, previous_h_pre, params, iterations)
        if self.fault == "single-pass handoff detached":
            out["next_h_pre"] = out["next_h_pre"].detach()
        return out

    def stack(self, h, layers, head, iterations):
        if self.fault != "streams collapsed every layer":
            return super().stack(h, layers, head, iterations)
        t, c = h.shape
        n = layers[0][0].params.n
        x = h.unsqueeze(1).expand(t, n, c)
        for attn, mlp in layers:  # one stream carried between layers: expanded in, collapsed out of each
            x = self.layer(x.mean(dim=1, keepdim=True).expand(t, n, c), attn, mlp, iterations)
        return self.block_exit(x, head.fn, head.base, head.scale)


_SINGLE_PASS_OPS = frozenset({"coefficients", "aggregate", "mix", "sinkhorn", "single_pass"})
"""A single-pass mutant's ops (`mhc_core[deepseek_v41]`'s), its stack chained by the suite."""


def _mutant(
    fault: str,
    variant: str,
    caught_by: tuple[str, ...],
    spared: tuple[str, ...],
    ops: frozenset[str] = _ALL_OPS,
) -> Mutant:
    slug = fault.replace(" ", "-").replace("/", "-").lower()
    return Mutant(
        name=f"mutant[{slug}]",
        description=f"mhc_core[{variant}] with: {fault}",
        variant=variant,
        claims=variant,
        ops=ops,
        fault=fault,
        caught_by=caught_by,
        spared=spared,
    )


MUTANTS: tuple[Mutant, ...] = (
    _mutant(
        "residual mix untransposed",
        "megatron_dev",
        ("orientation", "mix", "layer"),
        ("sinkhorn", "coefficients", "aggregate"),
    ),
    _mutant(
        "norm eps inside the square root",
        "megatron_main",
        ("coefficients@rms1e-2",),
        ("mix", "sinkhorn", "aggregate"),
    ),
    _mutant(
        "Sinkhorn ends on a row pass",
        "megatron_main",
        ("exact-sums", "sinkhorn s10 it1", "coefficients"),
        ("mix", "aggregate"),
    ),
    _mutant(
        "bias pre/post halves swapped",
        "megatron_main",
        ("coefficients", "layer"),
        ("mix", "sinkhorn", "aggregate"),
    ),
    _mutant(
        "H_post without its factor 2", "paper", ("coefficients", "layer"), ("mix", "sinkhorn", "aggregate")
    ),
    _mutant(
        "gradient detached before Sinkhorn",
        "megatron_dev",
        ("coefficients", "layer", "sinkhorn s1 it20"),
        ("mix", "aggregate", "block-exit"),
    ),
    # mhc-pytorch 0.2.3's design: no n-stream residual between layers, so H_res acts on n equal copies
    _mutant(
        "streams collapsed every layer",
        "megatron_main",
        ("stack", "stack-grads"),
        ("coefficients", "aggregate", "mix", "sinkhorn", "layer", "block-exit", "orientation", "exact-sums"),
    ),
    # Single-pass (DeepSeek-V4.1): the handoff cut from autograd, and V4's aggregate in a V4.1 model
    _mutant(
        "single-pass handoff detached",
        "megatron_dev+eps_inside_sqrt",
        ("single-pass", "single-pass-stack", "single-pass-stack-grads"),
        ("coefficients", "aggregate", "mix", "sinkhorn"),
        _SINGLE_PASS_OPS,
    ),
    _mutant(
        "single-pass aggregate with its own H_pre",
        "megatron_dev+eps_inside_sqrt",
        ("single-pass", "single-pass@entry", "single-pass-stack"),
        ("coefficients", "aggregate", "mix", "sinkhorn"),
        _SINGLE_PASS_OPS,
    ),
)
