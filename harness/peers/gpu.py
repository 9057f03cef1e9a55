"""GPU-only peers: DeepSeek's TileKernels (training kernels, forward and backward) and the inference
engines' mHC ops, vLLM's and sglang's (forward only: `differentiable=False`), all TileLang.

They run on CUDA only: on a machine without a GPU (or without the package) they are skipped with the
reason. Inputs go to the GPU inside each op and the results come back to the inputs' device, so the
conformance checks (CPU tensors) are the CPU peers' own and the perf suite (CUDA tensors) times the
kernels without copies. Written against the APIs in `docs/conformance.md` (`tile-kernels` 2.1.0; vLLM's
`vllm/model_executor/layers/mhc.py` custom ops; sglang's `python/sglang/srt/layers/mhc.py`); they run
where `ci/gpu_check.sh` gets a GPU with the packages (its `conformance` step). TransformerEngine's Triton
mHC runs without a GPU too: `harness.peers.te_triton`.

TileKernels (streams before hidden, `[..., n, C]`): `mhc_pre` (norm, projection, coefficients with
`post_mult_value=2`, Sinkhorn with `sinkhorn_repeat` = the check's iterations, the aggregate),
`mhc_post` (the mix), `sinkhorn_normalize`. vLLM: `torch.ops.vllm.mhc_pre_tilelang` (coefficients and
the aggregate; its first nine arguments, common to every release), `mhc_post_tilelang` (the mix) and
`hc_head_fused_kernel_tilelang` (the block exit). sglang: `hc_split_sinkhorn` (Sinkhorn, driven with
zero pre / post logits, `hc_scale = 1`, `hc_base = 0`) and `mhc_post` (the mix); its `mhc_pre` takes
only `n*C` in {16384, 28672} at few tokens, so its coefficients are not comparable at the checks' sizes.
All three keep the residual streams in bf16 and their parameters in fp32; n = 4.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field

import torch

from harness.peers.base import Peer, SublayerParams, TimedFn, Timing

__all__ = ["SglangPeer", "TileKernelsPeer", "VllmPeer", "gpu_peers"]


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

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`coefficients`: `mhc_pre` (norm, projection, coefficients, Sinkhorn and the aggregate in one)."""
        return self.timed_coefficients(iterations)


_EPS = 1e-6
"""The eps of the norm, H_pre and Sinkhorn the inference engines are given (DeepSeek-V4's 1e-6)."""


@dataclass(frozen=True, kw_only=True)
class VllmPeer(Peer):
    """vLLM's mHC custom ops (see the module docstring)."""

    name: str = "vllm"
    description: str = "vLLM torch.ops.vllm mhc_pre / mhc_post / hc_head (TileLang, inference: forward only)"
    ops: frozenset[str] = frozenset({"coefficients", "mix", "block_exit"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    streams: tuple[int, ...] = (4,)
    differentiable: bool = False
    differences: dict[str, str] = field(default_factory=lambda: {
        "sinkhorn": "no standalone Sinkhorn op (it is inside mhc_pre): checked through coefficients",
        "coefficients": "RMS eps inside the square root; the aggregate in bf16"})

    def version(self) -> str | None:
        return _version("vllm")

    def unavailable(self) -> str | None:
        return _no_gpu("vllm", "vllm.model_executor.layers.mhc", "pip install vllm")

    @staticmethod
    def _ops():
        import vllm.model_executor.layers.mhc  # noqa: F401 - registers torch.ops.vllm.mhc_*

        return torch.ops.vllm

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        scale = torch.cat([params.alpha_pre, params.alpha_post, params.alpha_res]).float()
        post, comb, layer_input = self._ops().mhc_pre_tilelang(
            _cuda(x), _cuda(params.weight.float()), _cuda(scale), _cuda(params.bias.float()), _EPS, _EPS, _EPS, 2.0,
            iterations)
        home = x.device
        return {"h_post": post.reshape(t, n).to(home), "h_res": comb.reshape(t, n, n).to(home),
                "aggregate": layer_input.reshape(t, c).to(home)}

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._ops().mhc_post_tilelang(_cuda(y), _cuda(residual), _cuda(h_post.float()).reshape(t, n, 1),
                                            _cuda(h_res.float()))
        return out.reshape(t, n, c).to(residual.device)

    def block_exit(self, x, head_fn, head_base, head_scale):
        t, n, c = x.shape
        out = torch.empty(t, c, dtype=torch.bfloat16, device="cuda")
        self._ops().hc_head_fused_kernel_tilelang(_cuda(x), _cuda(head_fn.float()), _cuda(head_scale.float()),
                                                  _cuda(head_base.float()), out, c, _EPS, _EPS, n)
        return out.to(x.device)


@dataclass(frozen=True, kw_only=True)
class SglangPeer(Peer):
    """sglang's mHC kernels (see the module docstring)."""

    name: str = "sglang"
    description: str = "sglang sglang.srt.layers.mhc hc_split_sinkhorn / mhc_post (TileLang, inference: forward only)"
    ops: frozenset[str] = frozenset({"sinkhorn", "mix"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    streams: tuple[int, ...] = (4,)
    differentiable: bool = False
    differences: dict[str, str] = field(default_factory=lambda: {
        "coefficients": "mhc_pre takes only n*C in {16384, 28672} at <= 2048 tokens (its split-K GEMM): not at the "
                        "checks' C = 8",
        "sinkhorn": "fp32 Sinkhorn of bf16-rounded logits"})

    def version(self) -> str | None:
        return _version("sglang")

    def unavailable(self) -> str | None:
        return _no_gpu("sglang", "sglang.srt.layers.mhc", "pip install sglang")

    @staticmethod
    def _mhc():
        import sglang.srt.layers.mhc as mhc

        return mhc

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        mixes = torch.zeros(1, t, (2 + n) * n, dtype=torch.float32, device="cuda")
        mixes[..., 2 * n:] = _cuda(logits.float()).reshape(1, t, n * n)
        ones, zeros = torch.ones(3, device="cuda"), torch.zeros((2 + n) * n, device="cuda")
        _, _, comb = self._mhc().hc_split_sinkhorn(mixes, ones, zeros, hc_mult=n, sinkhorn_iters=iterations, eps=_EPS)
        return comb.reshape(t, n, n).to(logits.device)

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._mhc().mhc_post(_cuda(y), _cuda(residual), _cuda(h_post.float()).reshape(t, n, 1),
                                   _cuda(h_res.float()))
        return out.reshape(t, n, c).to(residual.device)


def gpu_peers() -> list[Peer]:
    """The GPU-only peers (each skipped with its reason where it cannot run)."""
    return [TileKernelsPeer(), VllmPeer(), SglangPeer()]
