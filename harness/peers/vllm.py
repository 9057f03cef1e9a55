"""vLLM's mHC (its DeepSeek-V4 serving path) as two peers, forward only, bf16, from the installed 0.33.0 wheel.

The wheel is a CUDA build (its `_C` extension does not load on a CPU machine), installed without its
dependencies; the adapters execute vLLM's own kernel files on their own
(`harness.upstream.source_tree.load_file`):

- `vllm`: `vllm/model_executor/kernels/mhc/torch.py`, the eager kernels vLLM's `forward_native` runs
  (`mhc_pre_torch`: projection, RMS, coefficients, Sinkhorn and the layer input; `mhc_post_torch`: the mix);
  it asserts bf16 streams, so its checks run in bf16 only;
- `vllm[triton]`: `vllm/model_executor/kernels/mhc/triton.py`, its Triton kernels, through Triton's
  interpreter without a GPU: `hc_collapse_triton` (the layer input from given `h_pre`) and
  `hc_head_reduce_triton_kernel` (the block exit: a weight-free RMSNorm kernel whose output is rounded to
  bf16 before the fp32 projection, then the weighted sum of the streams). The file's two imports of vLLM
  (`vllm.triton_utils`, whose `tl` / `triton` are triton's own, and `direct_register_custom_op`, which
  registers the functions as `torch.ops.vllm.*`: not needed to call them) are stood in.

- `vllm[v4.1]`: the same file's `mhc_pre_delayed_torch`, DeepSeek-V4.1's single-pass pre (the layer input weighted
  with the previous sublayer's `pre_mix`, stream 0 without one, and this sublayer's `pre` returned for the next);
  it computes in fp32 whatever the streams' dtype, so its checks run in bf16 and fp32 (where the norm's eps
  placement shows);
- `vllm[v4.1,triton]`: the same file's Triton kernels of the V4.1 seam, interpreted on CPU: `hc_collapse_triton`
  (the layer input: bf16 streams weighted with the fp32 `pre_mix` the previous sublayer handed on) and
  `mhc_pre_mix_triton` (the next `pre_mix`, recovered from a split-K projection's partial sums and square sums, as
  its ROCm path feeds it from AITER's `mhc_pre_big_fuse`; AITER does not run here, so those partial sums are formed
  by the adapter in fp32 over two halves of `n*C`). H_post and H_res are AITER's (not run): its single-pass checks
  compare the layer input (bf16 only: `hc_collapse_triton` asserts bf16 streams) and the next H_pre (bf16 and
  fp32, where the eps placement shows).

vLLM's fused pre / post / post-pre kernels are TileLang: `vllm[tilelang]` runs them on a GPU, with vLLM installed
with its dependencies (skipped with the reason elsewhere). Parameter map and layout:
as sglang's (`harness.peers.sglang`): `hc_fn` `[N, n*C]` fp32, `hc_scale [3]`, `hc_base [N]`, eps 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from harness.peers.base import Peer, SublayerParams
from harness.peers.gpu_support import cuda, no_gpu
from harness.peers.installed import InstalledFiles, stand_in
from harness.peers.pre_post import PrePostPeer
from harness.peers.sglang import EPS, device_for_triton, hc_params
from harness.peers.triton_interpreter import interpreted, prepare_interpreter
from harness.upstream.source_tree import load_file, placeholder_packages

__all__ = [
    "TORCH_FILE",
    "TRITON_FILE",
    "VLLM",
    "VllmPeer",
    "VllmSinglePassPeer",
    "VllmSinglePassTritonPeer",
    "VllmTileLangPeer",
    "VllmTritonPeer",
    "load_vllm_file",
]

TORCH_FILE = "vllm/model_executor/kernels/mhc/torch.py"
TRITON_FILE = "vllm/model_executor/kernels/mhc/triton.py"
VLLM = InstalledFiles(dist="vllm", version="0.33.0", files=(TORCH_FILE, TRITON_FILE))
_PACKAGES = (
    "vllm",
    "vllm.utils",
    "vllm.model_executor",
    "vllm.model_executor.kernels",
    "vllm.model_executor.kernels.mhc",
)


def _runtime() -> list[ModuleType]:
    import triton
    import triton.language as tl

    return [
        stand_in("vllm.triton_utils", triton=triton, tl=tl),
        stand_in("vllm.utils.torch_utils", direct_register_custom_op=lambda **kwargs: None),
    ]


@cache
def load_vllm_file(path: Path, name: str) -> ModuleType:
    """vLLM's kernel file at `path` as `vllm.model_executor.kernels.mhc.<name>`; loaded once per path."""
    if name == "triton":
        prepare_interpreter()
    with placeholder_packages(_PACKAGES, _runtime() if name == "triton" else []):
        return load_file(f"vllm.model_executor.kernels.mhc.{name}", path)


@dataclass(frozen=True, kw_only=True)
class VllmPeer(PrePostPeer):
    """vLLM's eager mHC kernels (see the module docstring)."""

    name: str = "vllm"
    description: str = "vLLM 0.33.0 vllm.model_executor.kernels.mhc.torch mhc_pre_torch / mhc_post_torch"
    ops: frozenset[str] = frozenset({"coefficients", "mix", "sinkhorn", "layer"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    """bf16: `mhc_pre_torch` asserts bf16 streams (what it serves in)."""
    pre_dtype: torch.dtype | None = torch.bfloat16
    differentiable: bool = False
    claims: str | None = "megatron_dev"
    """DeepSeek-V4's variant; bf16 checks cannot see the norm's eps placement (sglang's fp32 row does)."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "aggregate": "mhc_pre_torch computes the layer input from its own h_pre (checked inside coefficients); "
            "hc_collapse_triton takes a given h_pre: the vllm[triton] row",
            "block_exit": "the exit is a Triton kernel: the vllm[triton] row",
        }
    )
    source: Path | None = None
    """The file to run (default: the installed wheel's); a copy, for the planted-fault tests."""
    file: str = TORCH_FILE

    def version(self) -> str | None:
        v = VLLM.installed_version()
        return (
            None if v is None else f"{v} (interpreted)" if interpreted() and self.file == TRITON_FILE else v
        )

    def unavailable(self) -> str | None:
        why = VLLM.unavailable() if self.source is None else None
        if why:
            return why
        try:
            self.module()
        except Exception as exc:  # a file that does not load is a reason, not a crash
            return f"vLLM's mHC file failed to load: {type(exc).__name__}: {exc}"
        return None

    def module(self) -> ModuleType:
        return load_vllm_file(self.source or VLLM.path(self.file), Path(self.file).stem)

    def files(self) -> InstalledFiles:
        return VLLM

    def pre(
        self, x: torch.Tensor, p: SublayerParams, iterations: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(layer_input [T, C], h_res [T, n, n], h_post [T, n])` of `x [T, n, C]` (`mhc_pre_torch`)."""
        t, n, _ = x.shape
        fn, scale, base = hc_params(p)
        post, comb, y = self.module().mhc_pre_torch(
            x.contiguous(), fn, scale, base, EPS, EPS, EPS, 2.0, iterations
        )
        return y, comb, post.reshape(t, n)

    def post(
        self, y: torch.Tensor, x: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
    ) -> torch.Tensor:
        """The next streams `[T, n, C]` (`mhc_post_torch`)."""
        return self.module().mhc_post_torch(y, x, h_post.unsqueeze(-1), h_res)


@dataclass(frozen=True, kw_only=True)
class VllmSinglePassPeer(VllmPeer):
    """vLLM's eager DeepSeek-V4.1 single-pass pre (`mhc_pre_delayed_torch`; see the module docstring)."""

    name: str = "vllm[v4.1]"
    description: str = "vLLM 0.33.0 vllm.model_executor.kernels.mhc.torch mhc_pre_delayed_torch (DeepSeek-V4.1 single-pass pre)"
    ops: frozenset[str] = frozenset({"single_pass"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    """bf16, what it serves in, and fp32: its math is fp32 either way, and fp32 shows the norm's eps placement."""
    claims: str | None = "megatron_dev+eps_inside_sqrt"
    """DeepSeek-V4.1's numerics (`deepseek_v41`) as the checks can tell them apart: the coefficients' fp32 dtype
    does not show in a forward check."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "V4's per-sublayer pre is mhc_pre_torch: the vllm row",
            "mix": "the post is V4's mhc_post_torch: the vllm row",
        }
    )

    def single_pass(self, x, previous_h_pre, params: SublayerParams, iterations):
        """`{aggregate [T, C], next_h_pre [T, n], h_post [T, n], h_res [T, n, n]}` of `x [T, n, C]` weighted with
        `previous_h_pre [T, n]` (stream 0 when None)."""
        t, n, _ = x.shape
        fn, scale, base = hc_params(params)
        post, comb, layer_input, pre = self.module().mhc_pre_delayed_torch(
            x.contiguous(),
            fn,
            scale,
            base,
            EPS,
            EPS,
            EPS,
            2.0,
            iterations,
            pre_mix=None if previous_h_pre is None else previous_h_pre.float(),
        )
        return {"aggregate": layer_input, "next_h_pre": pre, "h_post": post.reshape(t, n), "h_res": comb}


@dataclass(frozen=True, kw_only=True)
class VllmSinglePassTritonPeer(VllmSinglePassPeer):
    """vLLM's V4.1 seam kernels `hc_collapse_triton` and `mhc_pre_mix_triton` (see the module docstring)."""

    name: str = "vllm[v4.1,triton]"
    description: str = (
        "vLLM 0.33.0 vllm.model_executor.kernels.mhc.triton hc_collapse_triton / mhc_pre_mix_triton (DeepSeek-V4.1 "
        "seam; interpreted without a GPU)"
    )
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    file: str = TRITON_FILE
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "V4's per-sublayer pre is the vllm row",
            "mix": "the post is V4's (the vllm row)",
        }
    )

    def unavailable(self) -> str | None:
        return VllmTritonPeer().unavailable() if self.source is None else super().unavailable()

    def single_pass(self, x, previous_h_pre, params: SublayerParams, iterations):
        """`{next_h_pre [T, n]}`, and `aggregate [T, C]` for bf16 streams where a previous `pre_mix` is given (the
        model's first seam takes stream 0 without a kernel)."""
        t, n, c = x.shape
        d = device_for_triton
        fn, scale, base = hc_params(params)
        flat = x.reshape(t, n * c).float()
        halves = (slice(0, n * c // 2), slice(n * c // 2, n * c))
        gemm = torch.stack([flat[:, h] @ fn[:, h].t() for h in halves])  # [2, T, N]: split-K partial sums
        sqrsum = torch.stack([flat[:, h].square().sum(-1) for h in halves])  # [2, T]
        module = self.module()
        out = {
            "next_h_pre": module.mhc_pre_mix_triton(
                d(gemm.contiguous()), d(sqrsum.contiguous()), d(scale), d(base), n, n * c, EPS, EPS
            ).to(x.device)
        }
        if previous_h_pre is not None and x.dtype == torch.bfloat16:
            out["aggregate"] = module.hc_collapse_triton(
                d(x.contiguous()), d(previous_h_pre.float().contiguous())
            ).to(x.device)
        return out


@dataclass(frozen=True, kw_only=True)
class VllmTritonPeer(VllmPeer):
    """vLLM's Triton mHC kernels (see the module docstring)."""

    name: str = "vllm[triton]"
    description: str = (
        "vLLM 0.33.0 vllm.model_executor.kernels.mhc.triton hc_collapse_triton / "
        "hc_head_reduce_triton_kernel (interpreted without a GPU)"
    )
    ops: frozenset[str] = frozenset({"aggregate", "block_exit"})
    claims: str | None = "megatron_dev+learned_exit"
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "vLLM's fused pre is TileLang (GPU only): the eager kernels are the vllm row",
            "mix": "as coefficients (the fused post is TileLang)",
            "block_exit": "its RMSNorm kernel rounds the normalised streams to bf16 before the fp32 projection",
        }
    )
    file: str = TRITON_FILE

    def unavailable(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (vLLM's kernels are Triton; the peers extra has triton 3.9.0)"
        return super().unavailable() or prepare_interpreter()

    def aggregate(self, x, h_pre):
        d = device_for_triton
        return self.module().hc_collapse_triton(d(x.contiguous()), d(h_pre.float().contiguous())).to(x.device)

    def block_exit(self, x, head_fn, head_base, head_scale):
        t, _, c = x.shape
        d = device_for_triton
        out = d(torch.empty(t, c, dtype=x.dtype))
        self.module().hc_head_reduce_triton_kernel(
            d(x.contiguous()),
            d(head_fn.float().contiguous()),
            d(head_scale.float()),
            d(head_base.float().contiguous()),
            out,
            EPS,
            EPS,
        )
        return out.to(x.device)


@dataclass(frozen=True, kw_only=True)
class VllmTileLangPeer(Peer):
    """vLLM's TileLang mHC custom ops, on a GPU (`torch.ops.vllm.mhc_pre_tilelang` / `mhc_post_tilelang` /
    `hc_head_fused_kernel_tilelang`, registered by importing `vllm.model_executor.layers.mhc`)."""

    name: str = "vllm[tilelang]"
    description: str = "vLLM torch.ops.vllm mhc_pre / mhc_post / hc_head (TileLang, inference: forward only)"
    ops: frozenset[str] = frozenset({"coefficients", "mix", "block_exit"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    streams: tuple[int, ...] = (4,)
    differentiable: bool = False
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "sinkhorn": "no standalone Sinkhorn op (it is inside mhc_pre): checked through coefficients",
            "coefficients": "RMS eps inside the square root; the aggregate in bf16",
        }
    )

    def version(self) -> str | None:
        return VLLM.installed_version()

    def unavailable(self) -> str | None:
        return no_gpu("vllm", "vllm.model_executor.layers.mhc", "pip install vllm")

    @staticmethod
    def _ops():
        import vllm.model_executor.layers.mhc  # noqa: F401 - registers torch.ops.vllm.mhc_*

        return torch.ops.vllm

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        scale = params.alphas().float()
        post, comb, layer_input = self._ops().mhc_pre_tilelang(
            cuda(x),
            cuda(params.weight.float()),
            cuda(scale),
            cuda(params.bias.float()),
            EPS,
            EPS,
            EPS,
            2.0,
            iterations,
        )
        home = x.device
        return {
            "h_post": post.reshape(t, n).to(home),
            "h_res": comb.reshape(t, n, n).to(home),
            "aggregate": layer_input.reshape(t, c).to(home),
        }

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._ops().mhc_post_tilelang(
            cuda(y), cuda(residual), cuda(h_post.float()).reshape(t, n, 1), cuda(h_res.float())
        )
        return out.reshape(t, n, c).to(residual.device)

    def block_exit(self, x, head_fn, head_base, head_scale):
        t, n, c = x.shape
        out = self._ops().hc_head_fused_kernel_tilelang(
            cuda(x), cuda(head_fn.float()), cuda(head_scale.float()), cuda(head_base.float()), EPS, EPS
        )
        return out.reshape(t, c).to(x.device)
