"""GPU peers: TransformerEngine's Triton mHC and DeepSeek's TileKernels, at fp32 and bf16 bounds.

Both run on CUDA only: on a machine without a GPU (or without the package) they are skipped with
the reason. Inputs go to the GPU inside each op and the results come back to the inputs' device, so
the conformance checks (CPU tensors) are the CPU peers' own and the perf suite (CUDA tensors) times
the kernels without copies. Written against the APIs in ``docs/conformance.md``
(TransformerEngine ``transformer_engine.pytorch.triton.mhc``, 2.20; ``tile-kernels`` 2.1.0); they
first run where ``ci/gpu_check.sh`` gets a GPU (its ``conformance`` step).

TransformerEngine (n = 4 only; streams last, ``[s, b, C, n]``): ``mhc_fused_projection`` +
``mhc_fused_scale`` (coefficients; its RMS has no eps), ``mhc_fused_sinkhorn`` (log domain),
``mhc_fused_aggregate``, ``mhc_fused_expand_combine`` (``f @ H_post + x @ H_res``), all with
``use_tf32=False`` in fp32. TileKernels (streams before hidden, ``[..., n, C]``): ``mhc_pre`` (norm,
projection, coefficients with ``post_mult_value=2``, Sinkhorn with ``sinkhorn_repeat`` = the check's
iterations, the aggregate), ``mhc_post`` (the mix), ``sinkhorn_normalize``.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass

import torch

from harness.peers.base import Peer, SublayerParams

__all__ = ["TeTritonPeer", "TileKernelsPeer", "gpu_peers"]


def _no_gpu(package: str, module: str, pip: str) -> str | None:
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


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")


@dataclass(frozen=True, kw_only=True)
class TeTritonPeer(Peer):
    """TransformerEngine's Triton mHC (see the module docstring)."""

    name: str = "te_triton"
    description: str = "TransformerEngine transformer_engine.pytorch.triton.mhc"
    ops: frozenset[str] = frozenset({"coefficients", "aggregate", "mix", "sinkhorn"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    streams: tuple[int, ...] = (4,)

    def version(self) -> str | None:
        return _version("transformer-engine") or _version("transformer_engine")

    def unavailable(self) -> str | None:
        return _no_gpu("transformer-engine", "transformer_engine.pytorch.triton.mhc", "pip install transformer-engine")

    @staticmethod
    def _te():
        import transformer_engine.pytorch.triton.mhc as te

        return te

    def _tf32(self, t: torch.Tensor) -> bool:
        return t.dtype != torch.float32

    def coefficients(self, x, params: SublayerParams, iterations):
        te = self._te()
        t, n, c = x.shape
        h, ms = te.mhc_fused_projection(_cuda(x.reshape(t, n * c)), _cuda(params.weight), use_tf32=self._tf32(x))
        alpha = _cuda(torch.cat([params.alpha_pre, params.alpha_post, params.alpha_res]))
        h_pre, h_post, logits = te.mhc_fused_scale(h, alpha, _cuda(params.bias).reshape(1, -1), ms, n)
        h_res = te.mhc_fused_sinkhorn(logits.reshape(t, 1, n, n), n=n, iters=iterations).reshape(t, n, n)
        agg = te.mhc_fused_aggregate(_cuda(x).permute(0, 2, 1).reshape(t, 1, c, n), h_pre.reshape(t, 1, n), n,
                                     use_tf32=self._tf32(x))
        home = x.device
        return {"h_pre": h_pre.to(home), "h_post": h_post.to(home), "h_res": h_res.to(home),
                "aggregate": agg.reshape(t, c).to(home)}

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        out = self._te().mhc_fused_aggregate(_cuda(x).permute(0, 2, 1).reshape(t, 1, c, n),
                                             _cuda(h_pre).reshape(t, 1, n), n, use_tf32=self._tf32(x))
        return out.reshape(t, c).to(x.device)

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._te().mhc_fused_expand_combine(
            _cuda(y).reshape(t, 1, c), None, _cuda(h_post).reshape(t, 1, n),
            _cuda(residual).permute(0, 2, 1).reshape(t, 1, c, n), _cuda(h_res).reshape(t, 1, n, n), n,
            use_tf32=self._tf32(residual))
        return out.reshape(t, c, n).permute(0, 2, 1).to(residual.device)

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        return self._te().mhc_fused_sinkhorn(_cuda(logits).reshape(t, 1, n, n), n=n,
                                             iters=iterations).reshape(t, n, n).to(logits.device)


@dataclass(frozen=True, kw_only=True)
class TileKernelsPeer(Peer):
    """DeepSeek TileKernels' mHC kernels (see the module docstring)."""

    name: str = "tile_kernels"
    description: str = "DeepSeek tile-kernels tile_kernels.modeling.mhc (TileLang)"
    ops: frozenset[str] = frozenset({"coefficients", "mix", "sinkhorn"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)  # residual streams are bf16, fn fp32
    streams: tuple[int, ...] = (4,)

    def version(self) -> str | None:
        return _version("tile-kernels")

    def unavailable(self) -> str | None:
        return _no_gpu("tile-kernels", "tile_kernels.modeling.mhc", "pip install tile-kernels==2.1.0")

    @staticmethod
    def _tk():
        import tile_kernels.modeling.mhc as tk

        return tk

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        scale = torch.cat([params.alpha_pre, params.alpha_post, params.alpha_res]).float()
        layer_input, (post, comb) = self._tk().mhc_pre(
            _cuda(x), _cuda(params.weight.float()), _cuda(scale), _cuda(params.bias.float()), mhc_mult=n,
            post_mult_value=2.0, sinkhorn_repeat=iterations)
        home = x.device
        return {"h_post": post.reshape(t, n).to(home), "h_res": comb.reshape(t, n, n).to(home),
                "aggregate": layer_input.reshape(t, c).to(home)}

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._tk().mhc_post(_cuda(y), _cuda(residual), _cuda(h_post.float()), _cuda(h_res.float()))
        return out.reshape(t, n, c).to(residual.device)

    def sinkhorn(self, logits, iterations):
        return self._tk().sinkhorn_normalize(_cuda(logits.float()), repeat=iterations).to(logits.device)


def gpu_peers() -> list[Peer]:
    """The GPU peers (each skipped with its reason where it cannot run)."""
    return [TeTritonPeer(), TileKernelsPeer()]
