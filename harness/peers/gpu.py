"""GPU-only peers: DeepSeek's TileKernels (training kernels, forward and backward), and the helpers of every
GPU-only peer; the serving engines' TileLang ops live with their engines (`harness.peers.vllm`,
`harness.peers.sglang`: `vllm[tilelang]`, `sglang[tilelang]`), and `gpu_peers` lists all three.

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

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass

import torch

from harness.peers.base import Peer, SublayerParams, TimedFn, Timing

__all__ = ["TileKernelsPeer", "cuda", "gpu_peers", "no_gpu"]


def no_gpu(package: str, module: str, pip: str) -> str | None:
    """None when a CUDA GPU is here and `module` of `package` imports, else why not (`pip`: how to install it)."""
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch.cuda.is_available() is False); {pip} runs on NVIDIA GPUs only"
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{package} is not installed ({pip})"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install is a reason, not a crash
        return f"{module} failed to import: {type(exc).__name__}: {exc}"
    return None


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cuda(t: torch.Tensor) -> torch.Tensor:
    """`t` on the GPU (the GPU peers' inputs; results go back to the inputs' device)."""
    return t.to("cuda")


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
        return _version("tile-kernels")

    def unavailable(self) -> str | None:
        return no_gpu("tile-kernels", "tile_kernels.modeling.mhc", "pip install tile-kernels==2.1.0")

    @staticmethod
    def _tk():
        import tile_kernels.modeling.mhc as tk

        return tk

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        scale = torch.cat([params.alpha_pre, params.alpha_post, params.alpha_res]).float()
        layer_input, (post, comb) = self._tk().mhc_pre(
            cuda(x), cuda(params.weight.float()), cuda(scale), cuda(params.bias.float()), mhc_mult=n,
            post_mult_value=2.0, sinkhorn_repeat=iterations)
        home = x.device
        return {"h_post": post.reshape(t, n).to(home), "h_res": comb.reshape(t, n, n).to(home),
                "aggregate": layer_input.reshape(t, c).to(home)}

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
    TileLang kernels in their engines' modules."""
    from harness.peers.sglang import SglangTileLangPeer
    from harness.peers.vllm import VllmTileLangPeer

    return [TileKernelsPeer(), VllmTileLangPeer(), SglangTileLangPeer()]
