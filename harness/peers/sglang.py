"""sglang's mHC (its DeepSeek-V4 serving path) as two peers, forward only, from the installed 0.5.23 wheel.

What runs is sglang's own file `sglang/kernels/ops/layernorm/mhc.py`, executed on its own
(`harness.upstream.source_tree.load_file`): the package's `__init__` imports sglang's runtime, which needs its
dependencies and a GPU. The file's imports of that runtime are stood in by modules that answer as a
machine without AMD or TileLang kernels would (`is_hip()` False, `SGLANG_USE_AITER` and the TileLang flags
off), so its dispatch takes the paths such a machine takes:

- `sglang`: the public entry points `hc_pre` (streams `[T, n*C]` -> layer input, `h_res`, `h_post`: the
  dispatch's torch path `_mhc_pre_torch`) and `hc_post` (`_mhc_post_torch`), which the engine runs where
  the TileLang kernels are off;
- `sglang[triton]`: the Triton kernels of the Blackwell path (`hc_mix_stats_sinkhorn`: the split-K
  projection with the row sum of squares, then RMS scaling, the coefficients and Sinkhorn in one kernel;
  `mhc_combine`: the layer input) and of the gfx1250 port of the split + Sinkhorn
  (`_hc_split_sinkhorn_triton`), through Triton's interpreter without a GPU; the mix is the torch
  `hc_post` (sglang's fused post is TileLang), and the block exit `fused_hc_head` (`mhc_head.py`).

- `sglang[tilelang]`: its TileLang kernels (`hc_split_sinkhorn`, `mhc_post`), on a GPU with sglang installed with
  its dependencies (skipped with the reason elsewhere).

Parameter map (reference -> sglang): `mapping_proj.weight` `[N, n*C]` -> `hc_fn` (fp32, the same
`[pre | post | res]` rows), `bias` -> `hc_base`, `(alpha_pre, alpha_post, alpha_res)` -> `hc_scale[3]`;
eps 1e-6 everywhere (`rms_eps`, `hc_eps`), as DeepSeek-V4's config. Layout: `[T, n, C]` -> `[T, n*C]`
(stream-major, as the reference). Inference kernels: no backward (`differentiable=False`); the checks run in
the dtype it serves in, bf16, and in fp32.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from harness.peers.base import Peer, SublayerParams
from harness.peers.gpu_support import cuda, no_gpu
from harness.peers.installed import InstalledFiles, stand_in
from harness.peers.pre_post import PrePostPeer
from harness.peers.triton_interpreter import interpreted, prepare_interpreter
from harness.upstream.source_tree import load_file, placeholder_packages

__all__ = [
    "EPS",
    "HEAD_FILE",
    "KERNEL_FILE",
    "SGLANG",
    "SglangPeer",
    "SglangTileLangPeer",
    "SglangTritonPeer",
    "device_for_triton",
    "hc_params",
    "load_sglang_mhc",
]

KERNEL_FILE = "sglang/kernels/ops/layernorm/mhc.py"
HEAD_FILE = "sglang/kernels/ops/layernorm/mhc_head.py"
SGLANG = InstalledFiles(dist="sglang", version="0.5.23", files=(KERNEL_FILE, HEAD_FILE))
EPS = 1e-6
"""DeepSeek-V4's `hc_eps` and `rms_norm_eps`."""
_PACKAGES = (
    "sglang",
    "sglang.kernels",
    "sglang.kernels.jit",
    "sglang.kernels.ops",
    "sglang.kernels.ops.layernorm",
    "sglang.srt",
    "sglang.srt.distributed",
    "sglang.srt.distributed.device_communicators",
    "sglang.srt.layers",
    "sglang.srt.layers.attention",
    "sglang.srt.layers.attention.dsa",
    "sglang.srt.layers.utils",
)
_FLAGS_OFF = (
    "SGLANG_USE_AITER",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE",
    "SGLANG_OPT_USE_TILELANG_MHC_POST",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM",
)
"""The `envs` flags the file reads, each off: no AMD kernels, no TileLang, no DeepGEMM."""


class _Envs:
    """`sglang.srt.environ.envs` for the flags the file reads (`_FLAGS_OFF`); another name is an error naming it."""

    def __getattr__(self, name: str) -> SimpleNamespace:
        if name not in _FLAGS_OFF:
            raise AttributeError(
                f"sglang's mHC file read envs.{name}, which the stand-in runtime does not answer "
                f"(it answers {', '.join(_FLAGS_OFF)})"
            )
        return SimpleNamespace(get=lambda: False)


def _runtime() -> list[ModuleType]:
    """Stand-ins for the sglang runtime names the file imports (a CPU machine's answers)."""
    no = lambda *a, **k: False  # noqa: E731 - a predicate that answers no
    return [
        stand_in("sglang.kernels.jit.utils", is_arch_support_pdl=no),
        stand_in(
            "sglang.srt.distributed.device_communicators.pynccl_allocator",
            use_symmetric_memory=lambda *a, **k: nullcontext(),
        ),
        stand_in("sglang.srt.environ", envs=_Envs()),
        stand_in("sglang.srt.layers.attention.dsa.utils", is_dsa_prefill_cp_interleave=no),
        stand_in("sglang.srt.layers.dp_attention", is_allocation_symmetric=no),
        stand_in("sglang.srt.layers.utils.common", strict_contiguous=lambda t: t.contiguous()),
        stand_in(
            "sglang.srt.runtime_context",
            get_parallel=lambda: None,
            get_platform=lambda: SimpleNamespace(is_sm90=False, is_sm100=False, is_blackwell=False),
        ),
        stand_in("sglang.srt.utils", package=True, is_gfx95_supported=no, is_hip=no),
        stand_in("sglang.srt.utils.common", is_gfx1250_supported=no),
    ]


@cache
def load_sglang_mhc(path: Path, name: str = "mhc") -> ModuleType:
    """sglang's file at `path` as the module `sglang.kernels.ops.layernorm.<name>` (see the module docstring);
    loaded once per path."""
    prepare_interpreter()
    with placeholder_packages(_PACKAGES, _runtime()):
        return load_file(f"sglang.kernels.ops.layernorm.{name}", path)


def device_for_triton(t: torch.Tensor) -> torch.Tensor:
    """`t` where the Triton kernels run: the CPU under the interpreter, else the GPU."""
    return t if interpreted() else t.to("cuda")


def hc_params(p: SublayerParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(hc_fn, hc_scale, hc_base)` in fp32, as sglang holds them."""
    return (
        p.weight.float().contiguous(),
        p.alphas().float(),
        p.bias.float().contiguous(),
    )


@dataclass(frozen=True, kw_only=True)
class SglangPeer(PrePostPeer):
    """sglang's `hc_pre` / `hc_post` (see the module docstring)."""

    name: str = "sglang"
    description: str = "sglang 0.5.23 sglang.kernels.ops.layernorm.mhc hc_pre / hc_post (torch path)"
    ops: frozenset[str] = frozenset({"coefficients", "mix", "sinkhorn", "layer"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    """bf16, the dtype it serves in; fp32 too, where the norm's eps placement shows (its math is fp32 either way)."""
    differentiable: bool = False
    claims: str | None = "megatron_dev+eps_inside_sqrt"
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "aggregate": "hc_pre computes the layer input from its own h_pre and does not return h_pre (the aggregate "
            "is checked inside coefficients)",
            "block_exit": "the exit is the Triton fused_hc_head: the sglang[triton] row",
        }
    )
    source: Path | None = None
    """The mHC file to run (default: the installed wheel's); a copy, for the planted-fault tests."""

    def version(self) -> str | None:
        v = SGLANG.installed_version()
        return None if v is None else f"{v} (interpreted)" if interpreted() and "triton" in self.name else v

    def unavailable(self) -> str | None:
        why = SGLANG.unavailable() if self.source is None else None
        if why:
            return why
        try:
            self.module()
        except Exception as exc:  # a file that does not load is a reason, not a crash
            return f"sglang's mHC file failed to load: {type(exc).__name__}: {exc}"
        return None

    def module(self) -> ModuleType:
        return load_sglang_mhc(self.source or SGLANG.path(KERNEL_FILE))

    def files(self) -> InstalledFiles:
        return SGLANG

    # -- the entry points ------------------------------------------------------------------------------------------

    def pre(
        self, x: torch.Tensor, p: SublayerParams, iterations: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(layer_input [T, C], h_res [T, n, n], h_post [T, n])` of `x [T, n, C]`."""
        t, n, c = x.shape
        fn, scale, base = hc_params(p)
        y, h_res, h_post, _ = self.module().hc_pre(
            x.reshape(t, n * c).contiguous(), fn, scale, base, n, EPS, EPS, iterations
        )
        return y, h_res.reshape(t, n, n), h_post.reshape(t, n)

    def post(
        self, y: torch.Tensor, x: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
    ) -> torch.Tensor:
        """The next streams `[T, n, C]` from the sublayer's output `y [T, C]` and the streams `x [T, n, C]`."""
        t, n, c = x.shape
        out = self.module().hc_post(
            y.contiguous(), x.reshape(t, n * c).contiguous(), h_post.float(), h_res.float(), n
        )
        return out.reshape(t, n, c)


@dataclass(frozen=True, kw_only=True)
class SglangTritonPeer(SglangPeer):
    """sglang's Triton mHC kernels (see the module docstring)."""

    name: str = "sglang[triton]"
    description: str = (
        "sglang 0.5.23 Triton kernels: hc_mix_stats_sinkhorn, mhc_combine, _hc_split_sinkhorn_triton "
        "(interpreted without a GPU); mix: hc_post"
    )
    ops: frozenset[str] = frozenset({"aggregate", "mix", "sinkhorn", "block_exit"})
    streams: tuple[int, ...] = (4,)
    """n = 4: `hc_mix_stats_sinkhorn` and the split + Sinkhorn kernel index `tl.arange(0, n)` (a power of 2)."""
    claims: str | None = "megatron_dev+learned_exit"
    """What its ops can show of DeepSeek-V4's configuration (no coefficients here: no eps placement)."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "its split-K projection (hc_mix_stats_sinkhorn) needs n*C a multiple of 64 and the checks' "
            "n*C is 32: run at C 64 by the train/serve measurement and test_serving.py",
            "layer": "as coefficients",
        }
    )

    def unavailable(self) -> str | None:
        why = super().unavailable()
        if why:
            return why
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (sglang's kernels are Triton; the peers extra has triton 3.9.0)"
        return prepare_interpreter()

    def pre(self, x, p, iterations):
        """The Blackwell path: `hc_mix_stats_sinkhorn` then `mhc_combine` (n*C a multiple of 64)."""
        t, n, c = x.shape
        mod, (fn, scale, base) = self.module(), (device_for_triton(a) for a in hc_params(p))
        flat = device_for_triton(x.reshape(t, n * c).contiguous())
        h_pre, h_post, h_res = mod.hc_mix_stats_sinkhorn(flat, fn, scale, base, n, iterations, EPS, EPS)
        return (
            mod.mhc_combine(flat, h_pre, n, x.dtype).to(x.device),
            h_res.to(x.device),
            h_post.to(x.device),
        )

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        return (
            self.module()
            .mhc_combine(
                device_for_triton(x.reshape(t, n * c).contiguous()),
                device_for_triton(h_pre.float().contiguous()),
                n,
                x.dtype,
            )
            .to(x.device)
        )

    def sinkhorn(self, logits, iterations):
        """`_hc_split_sinkhorn_triton` with the logits as the `comb` part of `mixes`, scale 1, base 0."""
        t, n, _ = logits.shape
        mixes = torch.cat([torch.zeros(t, 2 * n), logits.reshape(t, n * n).float()], dim=1).reshape(1, t, -1)
        _, _, comb = self.module()._hc_split_sinkhorn_triton(
            device_for_triton(mixes),
            device_for_triton(torch.ones(3)),
            device_for_triton(torch.zeros(n * n + 2 * n)),
            n,
            iterations,
            EPS,
        )
        return comb.reshape(t, n, n).to(logits.device, logits.dtype)

    def block_exit(self, x, head_fn, head_base, head_scale):
        """`fused_hc_head` (`mhc_head.py`): RMS, projection, `sigmoid + eps`, the weighted sum of the streams."""
        head = load_sglang_mhc(SGLANG.path(HEAD_FILE), "mhc_head")
        return head.fused_hc_head(
            device_for_triton(x.contiguous()),
            device_for_triton(head_fn.float().contiguous()),
            device_for_triton(head_scale.float()),
            device_for_triton(head_base.float().contiguous()),
            EPS,
            EPS,
        ).to(x.device)


@dataclass(frozen=True, kw_only=True)
class SglangTileLangPeer(Peer):
    """sglang's TileLang mHC kernels, on a GPU with sglang installed with its dependencies: `hc_split_sinkhorn`
    (driven with zero pre / post logits, `hc_scale = 1`, `hc_base = 0`) and `mhc_post` (the mix)."""

    name: str = "sglang[tilelang]"
    description: str = "sglang sglang.kernels.ops.layernorm.mhc hc_split_sinkhorn / mhc_post (TileLang, GPU)"
    ops: frozenset[str] = frozenset({"sinkhorn", "mix"})
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    streams: tuple[int, ...] = (4,)
    differentiable: bool = False
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "mhc_pre takes only n*C in {16384, 28672} at <= 2048 tokens (its split-K GEMM): not at the "
            "checks' C = 8; the torch path and the Triton kernels are the sglang and sglang[triton] rows",
            "sinkhorn": "fp32 Sinkhorn of bf16-rounded logits",
        }
    )

    def version(self) -> str | None:
        return SGLANG.installed_version()

    def unavailable(self) -> str | None:
        return no_gpu("sglang", "sglang.kernels.ops.layernorm.mhc", "pip install sglang")

    @staticmethod
    def _mhc():
        import sglang.kernels.ops.layernorm.mhc as mhc

        return mhc

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        mixes = torch.zeros(1, t, (2 + n) * n, dtype=torch.float32, device="cuda")
        mixes[..., 2 * n :] = cuda(logits.float()).reshape(1, t, n * n)
        ones, zeros = torch.ones(3, device="cuda"), torch.zeros((2 + n) * n, device="cuda")
        _, _, comb = self._mhc().hc_split_sinkhorn(
            mixes, ones, zeros, hc_mult=n, sinkhorn_iters=iterations, eps=EPS
        )
        return comb.reshape(t, n, n).to(logits.device)

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        out = self._mhc().mhc_post(
            cuda(y), cuda(residual), cuda(h_post.float()).reshape(t, n, 1), cuda(h_res.float())
        )
        return out.reshape(t, n, c).to(residual.device)
