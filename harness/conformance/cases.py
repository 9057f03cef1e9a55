"""Seeded inputs of the conformance checks, made in fp64 and rounded once to the dtype under test.

Every case is chosen so that the variants can be told apart: alphas well away from their 0.01 init
and a random bias make `H_res` non-uniform and non-symmetric, the `pre` and `post` halves of
the bias differ, and the streams of `x` differ from each other (at init, with identical streams,
the orientation of the mix would not show; `docs/functional.md`, "Bands").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.peers.base import Sublayer, SublayerParams

__all__ = ["TOKENS", "WIDTH", "Case", "make_case", "params", "sublayer_fn"]

TOKENS = 6
"""T of every case: small, so that a peer driven one token at a time stays fast."""
WIDTH = 8
"""C, per stream."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """The inputs of every op for one n (fp64 masters; `cast` rounds them to the dtype under test)."""

    n: int
    x: torch.Tensor
    """`[T, n, C]`, RMS ~1."""
    params: SublayerParams
    mlp_params: SublayerParams
    h_pre: torch.Tensor
    """`[T, n]` in (0.1, 1)."""
    h_post: torch.Tensor
    """`[T, n]` in (0.2, 1.8)."""
    h_res: torch.Tensor
    """`[T, n, n]`: positive, non-symmetric, not stochastic (an op-level mix need not take Sinkhorn's output)."""
    y: torch.Tensor
    """`[T, C]`: a sublayer output."""
    logits: torch.Tensor
    """`[T, n, n]` standard normal: Sinkhorn input before its scale."""
    head_fn: torch.Tensor
    head_base: torch.Tensor
    head_scale: torch.Tensor
    attn_w: torch.Tensor
    mlp_w: torch.Tensor
    seed: int

    def cast(self, dtype: torch.dtype) -> Case:
        """The same case with every tensor rounded to `dtype` (then kept there)."""
        def c(t):
            return t.to(dtype)

        def cp(p: SublayerParams) -> SublayerParams:
            return SublayerParams(n=p.n, weight=c(p.weight), alpha_pre=c(p.alpha_pre), alpha_post=c(p.alpha_post),
                                  alpha_res=c(p.alpha_res), bias=c(p.bias))

        return Case(n=self.n, x=c(self.x), params=cp(self.params), mlp_params=cp(self.mlp_params),
                    h_pre=c(self.h_pre), h_post=c(self.h_post), h_res=c(self.h_res), y=c(self.y),
                    logits=c(self.logits), head_fn=c(self.head_fn), head_base=c(self.head_base),
                    head_scale=c(self.head_scale), attn_w=c(self.attn_w), mlp_w=c(self.mlp_w), seed=self.seed)


def params(n: int, c: int, g: torch.Generator) -> SublayerParams:
    """Random reference parameters: xavier-scale weight, alphas (0.7, 0.9, 1.3), a normal bias."""
    big = n * n + 2 * n
    weight = torch.randn(big, n * c, generator=g, dtype=torch.float64) * (2.0 / (big + n * c)) ** 0.5 * 3
    bias = torch.randn(big, generator=g, dtype=torch.float64) * 0.5
    return SublayerParams(n=n, weight=weight, alpha_pre=torch.tensor([0.7], dtype=torch.float64),
                          alpha_post=torch.tensor([0.9], dtype=torch.float64),
                          alpha_res=torch.tensor([1.3], dtype=torch.float64), bias=bias)


def sublayer_fn(w: torch.Tensor):
    """The deterministic stand-in for attention / MLP: `y [T, C] -> tanh(y @ w)`."""
    return lambda y: torch.tanh(y @ w.to(y.dtype))


def make_case(n: int, *, seed: int = 0, x_scale: float = 1.0) -> Case:
    """The seeded case for `n` streams; `x_scale` scales `x` (its RMS)."""
    g = torch.Generator().manual_seed(1000 * seed + n)
    t, c = TOKENS, WIDTH
    x = torch.randn(t, n, c, generator=g, dtype=torch.float64) * x_scale
    return Case(
        n=n, x=x, params=params(n, c, g), mlp_params=params(n, c, g),
        h_pre=0.1 + 0.9 * torch.rand(t, n, generator=g, dtype=torch.float64),
        h_post=0.2 + 1.6 * torch.rand(t, n, generator=g, dtype=torch.float64),
        h_res=0.05 + torch.rand(t, n, n, generator=g, dtype=torch.float64),
        y=torch.randn(t, c, generator=g, dtype=torch.float64),
        logits=torch.randn(t, n, n, generator=g, dtype=torch.float64),
        head_fn=torch.randn(n, n * c, generator=g, dtype=torch.float64) * 0.3,
        head_base=torch.randn(n, generator=g, dtype=torch.float64) * 0.5,
        head_scale=torch.tensor([0.8], dtype=torch.float64),
        attn_w=torch.randn(c, c, generator=g, dtype=torch.float64) / c ** 0.5,
        mlp_w=torch.randn(c, c, generator=g, dtype=torch.float64) / c ** 0.5,
        seed=seed,
    )


def sublayers(case: Case) -> tuple[Sublayer, Sublayer]:
    """The attention-like and MLP-like sublayers of a `layer` check."""
    return (Sublayer(params=case.params, f=sublayer_fn(case.attn_w)),
            Sublayer(params=case.mlp_params, f=sublayer_fn(case.mlp_w)))
