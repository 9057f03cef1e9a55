"""lucidrains `hyper-connections` (0.4.11), its mHC mode, as a peer (pure PyTorch, CPU).

What runs is the package's own code: `sinkhorn_knopps` and `ManifoldConstrainedHyperConnections`'s
`width_connection` (the aggregate and the mix) and `depth_connection` (the gated output).

Its coefficients are not the reference's, and the adapter says how, instead of a bare "fail":
each stream is normalised on its own by an RMSNorm over C with a learned gain, and each stream's
`pre` weight and row of `H_res` come from a projection shared by the streams (`dynamic_alpha_fn`
`[C, 1 + n]`) added to a static one-hot / identity init, where the reference normalises all n*C
values at once and projects them with one `[N, n*C]` matrix plus a bias. So the parameters do not
map onto each other, and the coefficient and layer checks are reported not comparable, with that
reason. The ops that do map run through the module with its dynamic projections zeroed and its
constraint switched off (`residual_mix_constraint_fn` = identity), so that given coefficients go in
as its static parameters: `static_alpha = [logit(h_pre) | H]` and `static_beta =
logit(h_post / 2)`, one module per token (they are per module). Layout: streams folded into the
batch, `[(b n), C]`.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field

import torch

from harness.peers.base import Peer, TimedFn, Timing

__all__ = ["LucidrainsPeer", "VERSION"]

VERSION = "0.4.11"

_COEFFICIENTS = (
    "each stream is normalised on its own (RMSNorm over C with a learned gain; the reference: one RMS "
    "over all n*C values, no gain), and its pre weight and H_res row come from a [C, 1 + n] projection "
    "shared by the streams plus a static one-hot / identity init (the reference: one [N, n*C] "
    "projection of all streams plus a bias), so the parameters do not map onto each other"
)


def _module(n: int, c: int, dtype: torch.dtype):
    from hyper_connections.manifold_constrained_hyper_connections import ManifoldConstrainedHyperConnections

    mod = ManifoldConstrainedHyperConnections(n, dim=c, layer_index=0, residual_mix_constraint_fn=lambda t: t)
    mod = mod.to(dtype)
    with torch.no_grad():
        mod.dynamic_alpha_fn.zero_()
        mod.dynamic_beta_fn.zero_()
    return mod


@dataclass(frozen=True, kw_only=True)
class LucidrainsPeer(Peer):
    """lucidrains `hyper-connections`' mHC (see the module docstring)."""

    name: str = "lucidrains"
    description: str = "lucidrains hyper-connections ManifoldConstrainedHyperConnections"
    ops: frozenset[str] = frozenset({"aggregate", "mix", "sinkhorn"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # it upcasts to fp32 whatever the input
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": _COEFFICIENTS,
            "layer": "its sublayer computes the coefficients above, so it cannot be fed the reference's parameters",
            "block_exit": "its streams are reduced by a plain sum (reduce_fn); it has no learned contraction",
            "stack": "its layers compute the coefficients above and its exit sums the streams, so its stack cannot be "
            "fed the reference's parameters",
        }
    )
    timing: Timing | None = Timing(variant="paper", ops=frozenset({"sinkhorn"}))

    def version(self) -> str | None:
        try:
            return md.version("hyper-connections")
        except md.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("hyper_connections") is None:
            return f"hyper-connections is not installed (pip install hyper-connections=={VERSION}; tox -e conformance has it)"
        return None

    def _width_depth(self, h_res, residual, h_post, h_pre, y):
        """Per token: the module's branch input (aggregate) and its new streams."""
        t, n, c = residual.shape
        agg, out = [], []
        for i in range(t):
            mod = _module(n, c, residual.dtype)
            del mod.static_alpha, mod.static_beta
            mod.static_alpha = torch.cat([torch.logit(h_pre[i]).unsqueeze(-1), h_res[i]], dim=-1)
            mod.static_beta = torch.logit(h_post[i] / 2)
            branch_input, add_residual = mod(residual[i])  # [(b n), C] with b = 1
            agg.append(branch_input.reshape(c))
            out.append(add_residual(y[i].reshape(1, c)).reshape(n, c))
        return torch.stack(agg), torch.stack(out)

    def aggregate(self, x, h_pre):
        t, n, _ = x.shape
        eye = torch.eye(n, dtype=x.dtype).expand(t, n, n)
        ones = torch.ones(t, n, dtype=x.dtype)
        return self._width_depth(eye, x, ones, h_pre, torch.zeros(t, x.shape[-1], dtype=x.dtype))[0]

    def mix(self, h_res, residual, h_post, y):
        t, n, _ = residual.shape
        return self._width_depth(h_res, residual, h_post, torch.full((t, n), 0.5, dtype=residual.dtype), y)[1]

    def sinkhorn(self, logits, iterations):
        from hyper_connections.manifold_constrained_hyper_connections import sinkhorn_knopps

        return sinkhorn_knopps(logits, iters=iterations)

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`sinkhorn`: `sinkhorn_knopps` of the logits."""
        from hyper_connections.manifold_constrained_hyper_connections import sinkhorn_knopps

        return lambda d: (sinkhorn_knopps(d["logits"], iters=iterations),)
