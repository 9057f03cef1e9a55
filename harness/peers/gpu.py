"""GPU-only peers: DeepSeek's TileKernels (training kernels, forward and backward); the serving engines' TileLang
ops live with their engines (`harness.peers.vllm`,
`harness.peers.sglang`: `vllm[tilelang]`, `sglang[tilelang]`), flashinfer's in `harness.peers.flashinfer`, and
`gpu_peers` lists all four.

They run on CUDA only: on a machine without a GPU (or without the package) they are skipped with the
reason. Inputs go to the GPU inside each op and the results come back to the inputs' device, so the
conformance checks (CPU tensors) are the CPU peers' own and the perf suite (CUDA tensors) times the
kernels without copies. Written against `tile-kernels` 2.1.0 (`docs/conformance.md`); they run where
`ci/gpu_check.sh` gets a GPU with the packages (its `conformance` step). TransformerEngine's Triton mHC
runs without a GPU too: `harness.peers.te_triton`.

TileKernels (streams before hidden, `[..., n, C]`): `mhc_pre` (norm, projection, coefficients with
`post_mult_value=2`, Sinkhorn with `sinkhorn_repeat` = the check's iterations, the aggregate),
`mhc_post` (the mix), `sinkhorn_normalize`; the residual streams in bf16, parameters in fp32; n = 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.peers.base import Peer, SublayerParams, TimedFn, Timing
from harness.peers.gpu_support import cuda, no_gpu, package_version

__all__ = ["TileKernelsPeer", "gpu_peers"]


@dataclass(frozen=True, kw_only=True)
class TileKernelsPeer(Peer):
    """DeepSeek TileKernels' mHC kernels (see the module docstring)."""

    name: str = "tile_kernels"
    description: str = "DeepSeek tile-kernels tile_kernels.modeling.mhc (TileLang)"
    ops: frozenset[str] = frozenset({"coefficients", "mix", "sinkhorn"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)  # residual streams are bf16, fn fp32
    streams: tuple[int, ...] = (4,)
    timing: Timing | None = Timing(variant="megatron_dev", ops=frozenset({"coefficients"}), gpu_only=True)

    def version(self) -> str | None:
        return package_version("tile-kernels")

    def unavailable(self) -> str | None:
        return no_gpu("tile-kernels", "tile_kernels.modeling.mhc", "pip install tile-kernels==2.1.0")

    @staticmethod
    def _tk():
        import tile_kernels.modeling.mhc as tk

        return tk

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        scale = params.alphas().float()
        layer_input, (post, comb) = self._tk().mhc_pre(
            cuda(x),
            cuda(params.weight.float()),
            cuda(scale),
            cuda(params.bias.float()),
            mhc_mult=n,
            post_mult_value=2.0,
            sinkhorn_repeat=iterations,
        )
        home = x.device
        return {
            "h_post": post.reshape(t, n).to(home),
            "h_res": comb.reshape(t, n, n).to(home),
            "aggregate": layer_input.reshape(t, c).to(home),
        }

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._tk().mhc_post(cuda(y), cuda(residual), cuda(h_post.float()), cuda(h_res.float()))
        return out.reshape(t, n, c).to(residual.device)

    def sinkhorn(self, logits, iterations):
        return self._tk().sinkhorn_normalize(cuda(logits.float()), repeat=iterations).to(logits.device)

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`coefficients`: `mhc_pre` (norm, projection, coefficients, Sinkhorn and the aggregate in one)."""
        return self.timed_coefficients(iterations)


def gpu_peers() -> list[Peer]:
    """The GPU-only peers (each skipped with its reason where it cannot run): TileKernels here, the engines'
    TileLang kernels in their engines' modules, flashinfer's kernels in `harness.peers.flashinfer`."""
    from harness.peers.flashinfer import FlashinferPeer
    from harness.peers.sglang import SglangTileLangPeer
    from harness.peers.vllm import VllmTileLangPeer

    return [TileKernelsPeer(), VllmTileLangPeer(), SglangTileLangPeer(), FlashinferPeer()]
