"""Seeded inputs of the conformance checks, made in fp64 and rounded once to the dtype under test.

Every case is chosen so that the variants can be told apart: alphas well away from their 0.01 init
and a random bias make `H_res` non-uniform and non-symmetric, the `pre` and `post` halves of
the bias differ, and the streams of `x` differ from each other (at init, with identical streams,
the orientation of the mix would not show; `docs/functional.md`, "Bands").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.peers.base import Sublayer, SublayerParams

__all__ = ["STACK_LAYERS", "TOKENS", "WIDTH", "Case", "make_case", "params", "stack_layers", "sublayer_fn"]

TOKENS = 6
"""T of every case: small, so that a peer driven one token at a time stays fast."""
WIDTH = 8
"""C, per stream."""
STACK_LAYERS = 2
"""Layers of the `stack` checks (two sublayers each): one boundary between layers, where the streams must
stay n."""


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
    h0: torch.Tensor
    """`[T, C]`: the one stream a `stack` check expands (an embedding output)."""
    stack_params: tuple[tuple[SublayerParams, SublayerParams], ...]
    """`(attn, mlp)` parameters of each of the `STACK_LAYERS` layers."""
    stack_w: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """`(attn_w, mlp_w)` `[C, C]` of each layer's stand-in functions."""

    def cast(self, dtype: torch.dtype) -> Case:
        """The same case with every tensor rounded to `dtype` (then kept there)."""

        def c(t):
            return t.to(dtype)

        def cp(p: SublayerParams) -> SublayerParams:
            return SublayerParams(
                n=p.n,
                weight=c(p.weight),
                alpha_pre=c(p.alpha_pre),
                alpha_post=c(p.alpha_post),
                alpha_res=c(p.alpha_res),
                bias=c(p.bias),
            )

        return Case(
            n=self.n,
            x=c(self.x),
            params=cp(self.params),
            mlp_params=cp(self.mlp_params),
            h_pre=c(self.h_pre),
            h_post=c(self.h_post),
            h_res=c(self.h_res),
            y=c(self.y),
            logits=c(self.logits),
            head_fn=c(self.head_fn),
            head_base=c(self.head_base),
            head_scale=c(self.head_scale),
            attn_w=c(self.attn_w),
            mlp_w=c(self.mlp_w),
            seed=self.seed,
            h0=c(self.h0),
            stack_params=tuple((cp(a), cp(m)) for a, m in self.stack_params),
            stack_w=tuple((c(a), c(m)) for a, m in self.stack_w),
        )


def params(n: int, c: int, g: torch.Generator) -> SublayerParams:
    """Random reference parameters: xavier-scale weight, alphas (0.7, 0.9, 1.3), a normal bias."""
    big = n * n + 2 * n
    weight = torch.randn(big, n * c, generator=g, dtype=torch.float64) * (2.0 / (big + n * c)) ** 0.5 * 3
    bias = torch.randn(big, generator=g, dtype=torch.float64) * 0.5
    return SublayerParams(
        n=n,
        weight=weight,
        alpha_pre=torch.tensor([0.7], dtype=torch.float64),
        alpha_post=torch.tensor([0.9], dtype=torch.float64),
        alpha_res=torch.tensor([1.3], dtype=torch.float64),
        bias=bias,
    )


def sublayer_fn(w: torch.Tensor):
    """The deterministic stand-in for attention / MLP: `y [T, C] -> tanh(y @ w)`."""
    return lambda y: torch.tanh(y @ w.to(y.dtype))


def make_case(n: int, *, seed: int = 0, x_scale: float = 1.0) -> Case:
    """The seeded case for `n` streams; `x_scale` scales `x` (its RMS)."""
    g = torch.Generator().manual_seed(1000 * seed + n)
    t, c = TOKENS, WIDTH
    x = torch.randn(t, n, c, generator=g, dtype=torch.float64) * x_scale
    # Drawn in the order of the fields below, the stack's last: the earlier checks' inputs (and the
    # digests of their recordings) do not depend on it.
    case: dict[str, Any] = dict(
        params=params(n, c, g),
        mlp_params=params(n, c, g),
        h_pre=0.1 + 0.9 * torch.rand(t, n, generator=g, dtype=torch.float64),
        h_post=0.2 + 1.6 * torch.rand(t, n, generator=g, dtype=torch.float64),
        h_res=0.05 + torch.rand(t, n, n, generator=g, dtype=torch.float64),
        y=torch.randn(t, c, generator=g, dtype=torch.float64),
        logits=torch.randn(t, n, n, generator=g, dtype=torch.float64),
        head_fn=torch.randn(n, n * c, generator=g, dtype=torch.float64) * 0.3,
        head_base=torch.randn(n, generator=g, dtype=torch.float64) * 0.5,
        head_scale=torch.tensor([0.8], dtype=torch.float64),
        attn_w=torch.randn(c, c, generator=g, dtype=torch.float64) / c**0.5,
        mlp_w=torch.randn(c, c, generator=g, dtype=torch.float64) / c**0.5,
        seed=seed,
    )
    h0 = torch.randn(t, c, generator=g, dtype=torch.float64) * x_scale
    stack_params = tuple((params(n, c, g), params(n, c, g)) for _ in range(STACK_LAYERS))
    stack_w = tuple(
        (
            torch.randn(c, c, generator=g, dtype=torch.float64) / c**0.5,
            torch.randn(c, c, generator=g, dtype=torch.float64) / c**0.5,
        )
        for _ in range(STACK_LAYERS)
    )
    return Case(n=n, x=x, **case, h0=h0, stack_params=stack_params, stack_w=stack_w)


def sublayers(case: Case) -> tuple[Sublayer, Sublayer]:
    """The attention-like and MLP-like sublayers of a `layer` check."""
    return (
        Sublayer(params=case.params, f=sublayer_fn(case.attn_w), w=case.attn_w),
        Sublayer(params=case.mlp_params, f=sublayer_fn(case.mlp_w), w=case.mlp_w),
    )


def stack_layers(case: Case) -> list[tuple[Sublayer, Sublayer]]:
    """The `(attn, mlp)` sublayers of each layer of a `stack` check."""
    return [
        (Sublayer(params=a, f=sublayer_fn(wa), w=wa), Sublayer(params=m, f=sublayer_fn(wm), w=wm))
        for (a, m), (wa, wm) in zip(case.stack_params, case.stack_w, strict=True)
    ]
