"""A peer whose entry points are one connection's `pre` and `post` (the serving engines' `hc_pre` / `hc_post`,
`mhc_pre` / `mhc_post`): the checked ops built from those two, once for every such engine.

- `coefficients`: `pre` (layer input = the aggregate, `h_res`, `h_post`; no `h_pre`: the engines consume it);
- `mix`: `post` with given coefficients;
- `sinkhorn`: `pre` with the projection zeroed, so that `h_res` is the Sinkhorn of `hc_base`, set to the logits, one
  call per token (`pre_dtype`: the streams' dtype the engine's `pre` accepts; None: the logits');
- `layer`: `pre`, the sublayer, `post`, twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.peers.base import Peer, Sublayer, SublayerParams

__all__ = ["PrePostPeer"]


@dataclass(frozen=True, kw_only=True)
class PrePostPeer(Peer):
    """An engine's connection as `pre` and `post` (see the module docstring); subclasses implement those two."""

    pre_dtype: torch.dtype | None = None
    """The dtype of the streams `pre` accepts (None: any)."""

    def pre(
        self, x: torch.Tensor, p: SublayerParams, iterations: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(layer_input [T, C], h_res [T, n, n], h_post [T, n])` of `x [T, n, C]`."""
        raise NotImplementedError

    def post(
        self, y: torch.Tensor, x: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
    ) -> torch.Tensor:
        """The next streams `[T, n, C]` from the sublayer's output `y [T, C]` and the streams `x [T, n, C]`."""
        raise NotImplementedError

    def coefficients(self, x, params: SublayerParams, iterations):
        y, h_res, h_post = self.pre(x, params, iterations)
        return {"h_post": h_post, "h_res": h_res, "aggregate": y}

    def mix(self, h_res, residual, h_post, y):
        return self.post(y, residual, h_post, h_res)

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        out = []
        for i in range(t):
            p = SublayerParams(
                n=n,
                weight=torch.zeros(n * n + 2 * n, n),
                alpha_pre=torch.ones(1),
                alpha_post=torch.ones(1),
                alpha_res=torch.ones(1),
                bias=torch.cat([torch.zeros(2 * n), logits[i].reshape(n * n).float()]),
            )
            out.append(
                self.pre(torch.ones(1, n, 1, dtype=self.pre_dtype or logits.dtype), p, iterations)[1][0]
            )
        return torch.stack(out).to(logits.dtype)

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        h = x
        for sub in (attn, mlp):
            y, h_res, h_post = self.pre(h, sub.params, iterations)
            h = self.post(sub.f(y), h, h_post, h_res)
        return h
