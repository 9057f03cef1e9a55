"""flashinfer's mHC serving kernels as a GPU-only peer (`flashinfer-python` 0.7.2.post1).

`flashinfer.mhc.mhc_pre_big_fuse` takes the projection and the RMS square sum from outside (the
GEMM stays the caller's, as DeepSeek-V4's inference code does it) and fuses the RMS factor, the
coefficients, Sinkhorn and the layer input; `flashinfer.mhc.mhc_post` is the mix, `out[new] =
y * post[new] + sum_old residual[old] * comb[old, new]` (`comb^T @ residual`). Both are CUDA
kernels JIT-compiled by flashinfer, hard-wired to n = 4, bf16 streams, forward only; the wheel has
no CPU or Triton path, so on a machine without a GPU this row is skipped with that reason.

Driven as DeepSeek-V4's inference code drives it: `dot_mix = x_flat @ fn^T` and `sqrsum =
sum(x_flat^2)` in fp32 over `k = n*C` values, `mhc_scale` = the three alphas, `mhc_base` = the bias
(`[pre | post | res]`), `mhc_post_mult_value = 2` (`H_post = 2 sigmoid`), hc / Sinkhorn / RMS eps
1e-6, `sinkhorn_repeat` = the check's iterations. Written against the wheel's signatures; it has
not run on a GPU yet (`docs/conformance.md`).

Not adapted: `flashinfer.mega_mhc.prepare_mega_mhc` (experimental: projection, Sinkhorn, the mix and
the next sublayer's RMSNorm with FP8 outputs in one plan, with a `shifted_prev_mix`: DeepSeek-V4.1's
single-pass form).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.peers.base import Peer, SublayerParams
from harness.peers.gpu_support import cuda, no_gpu, package_version

__all__ = ["FlashinferPeer", "VERSION"]

VERSION = "0.7.2.post1"
EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class FlashinferPeer(Peer):
    """flashinfer's `mhc_pre_big_fuse` / `mhc_post` (see the module docstring)."""

    name: str = "flashinfer"
    description: str = "flashinfer flashinfer.mhc mhc_pre_big_fuse / mhc_post (CUDA, inference: forward only)"
    ops: frozenset[str] = frozenset({"coefficients", "mix"})
    dtypes: tuple[torch.dtype, ...] = (
        torch.bfloat16,
    )  # its streams are bf16 (the kernel allocates bf16 output)
    streams: tuple[int, ...] = (4,)  # hard-wired to HC = 4
    differentiable: bool = False
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "sinkhorn": "no standalone Sinkhorn (it is inside mhc_pre_big_fuse): checked through coefficients",
            "aggregate": "the layer input comes from its own h_pre (checked inside coefficients)",
            "block_exit": "no block exit kernel",
            "layer": "kernels only: no layer of its own",
            "stack": "kernels only: no model of its own",
        }
    )

    def version(self) -> str | None:
        return package_version("flashinfer-python")

    def unavailable(self) -> str | None:
        return no_gpu("flashinfer-python", "flashinfer.mhc", f"pip install flashinfer-python=={VERSION}")

    @staticmethod
    def _mhc():
        import flashinfer.mhc as fi

        return fi

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        flat = cuda(x).reshape(t, n * c).float()
        dot_mix = flat @ cuda(params.weight.float()).t()
        sqrsum = flat.square().sum(dim=-1)
        scale = params.alphas().float()
        post, comb, layer_input = self._mhc().mhc_pre_big_fuse(
            dot_mix,
            sqrsum,
            cuda(x).to(torch.bfloat16),
            cuda(scale),
            cuda(params.bias.float()),
            n * c,
            rms_eps=EPS,
            mhc_pre_eps=EPS,
            mhc_sinkhorn_eps=EPS,
            mhc_post_mult_value=2.0,
            sinkhorn_repeat=iterations,
        )
        home = x.device
        return {
            "h_post": post.reshape(t, n).to(home),
            "h_res": comb.reshape(t, n, n).to(home),
            "aggregate": layer_input.reshape(t, c).to(home, x.dtype),
        }

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._mhc().mhc_post(cuda(y), cuda(residual), cuda(h_post.float()), cuda(h_res.float()))
        return out.reshape(t, n, c).to(residual.device)
