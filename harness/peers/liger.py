"""Liger-Kernel's mHC as a peer (`liger-kernel` 0.8.5, Triton), interpreted on a machine without a GPU.

What runs is Liger's own functional API: `liger_mhc_coeffs` (the fused projection + RMS, the split,
the sigmoids and Sinkhorn, forward and backward kernels), `liger_mhc_pre` (the aggregate) and
`liger_mhc_post_res` (the residual mix `x_out[o] = sum_i h_res[o, i] x[i] + h_post[o] f`). Without
CUDA the Triton kernels run through Triton's interpreter (`TRITON_INTERPRET=1`, set before Liger is
imported), on CPU tensors: that checks the algorithm, indexing, masking and gradients in fp32, not GPU
rounding, tf32, the order of its atomics or speed (the row says "interpreted").

Parameter map (reference -> Liger): `mapping_proj.weight` `[N, n*C]` -> `phi = weight^T`
`[n*C, N]` (the same `[pre | post | res]` columns), `bias` -> `b`, the alphas as 0-d tensors; Liger's
defaults otherwise (`rms_eps` 1e-6, `pre_eps` 0, `sinkhorn_eps` 1e-6, `post_mult` 2). Layout:
`[T, n, C]` as is (`[..., n, C]`). Liger has no standalone Sinkhorn with a backward: Sinkhorn is
checked inside `coefficients` and `layer`.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field

import torch

from harness.peers.base import Peer, Sublayer, SublayerParams, TimedFn, Timing, timed_params
from harness.peers.triton_interpreter import interpreted, prepare_interpreter

__all__ = ["VERSION", "LigerPeer"]

VERSION = "0.8.5"
"""The liger-kernel release this adapter is written against."""


def _functional():
    from liger_kernel.transformers import functional

    return functional


@dataclass(frozen=True, kw_only=True)
class LigerPeer(Peer):
    """Liger-Kernel's `liger_mhc_*` functions (see the module docstring)."""

    name: str = "liger_kernel"
    description: str = "Liger-Kernel liger_mhc_coeffs / liger_mhc_pre / liger_mhc_post_res (Triton" + (
        ", interpreted on CPU)" if not torch.cuda.is_available() else ")"
    )
    ops: frozenset[str] = frozenset({"coefficients", "aggregate", "mix", "layer"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    """fp32 (`allow_fp32`; its kernels take bf16 / fp16 / fp32, not fp64)."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "sinkhorn": "no standalone Sinkhorn with a backward (it is inside liger_mhc_coeffs): checked through "
            "coefficients and layer",
            "block_exit": "no learned block exit",
            "coefficients": "RMS eps inside the square root (rsqrt(mean(x^2) + eps))",
        }
    )
    timing: Timing | None = Timing(
        variant="megatron_dev+eps_inside_sqrt+untransposed_mix",
        ops=frozenset({"coefficients", "layer_mhc"}),
        gpu_only=True,
    )
    """The configuration the conformance matrix finds it conforms to; timed on a GPU only (under Triton's
    interpreter its times mean nothing)."""

    def version(self) -> str | None:
        try:
            v = md.version("liger-kernel")
        except md.PackageNotFoundError:
            return None
        return f"{v} (interpreted)" if interpreted() else v

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("liger_kernel") is None:
            return (
                f"liger-kernel is not installed (pip install liger-kernel=={VERSION}; the peers extra has it)"
            )
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (liger-kernel's kernels are Triton; the peers extra has triton 3.9.0)"
        return prepare_interpreter()

    def _coeffs(self, x: torch.Tensor, params: SublayerParams, iterations: int):
        f = _functional()
        scalar = [
            a.reshape(()) for a in (params.alpha_pre, params.alpha_post, params.alpha_res)
        ]  # Liger: 0-d
        return f.liger_mhc_coeffs(
            x.contiguous(),
            params.weight.t().contiguous(),
            params.bias,
            *scalar,
            allow_fp32=True,
            tmax=iterations,
        )

    def coefficients(self, x, params: SublayerParams, iterations):
        h_pre, h_post, h_res = self._coeffs(x, params, iterations)
        return {"h_pre": h_pre, "h_post": h_post, "h_res": h_res}

    def aggregate(self, x, h_pre):
        return _functional().liger_mhc_pre(x.contiguous(), h_pre.contiguous())

    def mix(self, h_res, residual, h_post, y):
        return _functional().liger_mhc_post_res(
            residual.contiguous(), y.contiguous(), h_post.contiguous(), h_res.contiguous()
        )

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        f = _functional()
        h = x
        for sub in (attn, mlp):
            h_pre, h_post, h_res = self._coeffs(h, sub.params, iterations)
            y = sub.f(f.liger_mhc_pre(h.contiguous(), h_pre))
            h = f.liger_mhc_post_res(h.contiguous(), y.contiguous(), h_post, h_res)
        return h

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`coefficients`: `liger_mhc_coeffs` + `liger_mhc_pre`; `layer_mhc`: the two sublayers with
        `liger_mhc_post_res` and an identity branch."""
        f = _functional()

        def coefficients(d, k=0, x=None):
            x = d["x"] if x is None else x
            h_pre, h_post, h_res = self._coeffs(x, timed_params(d, k), iterations)
            return h_post, h_res, f.liger_mhc_pre(x.contiguous(), h_pre)

        def layer_mhc(d):
            x = d["x"]
            for k in (0, 1):
                h_post, h_res, agg = coefficients(d, k, x)
                x = f.liger_mhc_post_res(x.contiguous(), agg.contiguous(), h_post, h_res)
            return (x,)

        return coefficients if op == "coefficients" else layer_mhc
