"""TransformerEngine's Triton mHC as a peer: the installed package on a GPU, or the two files of a TE tree
run through Triton's interpreter on a machine without one.

TransformerEngine does not install on a CPU machine (its torch extension builds CUDA code), but its mHC is
two plain Triton files: `transformer_engine/common/triton/mhc.py` (the kernels) and
`transformer_engine/pytorch/triton/mhc.py` (the autograd wrappers). Given a TE source tree
(`--transformer-engine PATH`, else `$MHC_TRANSFORMER_ENGINE`), `load_te_mhc` executes exactly those
two files, without TE's package `__init__` or its compiled extension:

- the packages around them are empty placeholders while they load, and the one name the wrapper imports
  from the extension (`cpp_extensions.gemm.general_gemm`, cuBLAS, used by the projection backward when
  no RMSNorm weight is given) is a function that raises naming it; the checks pass a weight of ones, so the
  projection backward runs TE's Triton `dphi` kernel instead (`phi * 1` is exact);
- under the interpreter, `_support_tma` answers False (TMA descriptors need a GPU: the kernels take their
  plain-load path), every autotuner keeps its first configuration
  (`without_autotune_timing`), and the checks run inside
  `device_properties`, because the projection backward's pruner
  reads the device's shared memory (an H100's is stood in).

Layout (reference -> TE): streams last, `x [T, n, C]` -> `[s = T, b = 1, C, n]`; the projection's
columns follow that flattening, so `phi = weight.reshape(N, n, C).transpose(1, 2).reshape(N, n*C)`;
`alpha = [alpha_pre, alpha_post, alpha_res]`, `beta = bias [1, N]`. n = 4 only (TE asserts it). What
runs: `mhc_fused_projection` -> `mhc_fused_scale` -> `mhc_fused_sinkhorn` (log domain, stored
history recomputed) -> `mhc_fused_aggregate`, and `mhc_fused_expand_combine` (`f @ H_post + x @ H_res`)
for the mix, all with `use_tf32=False` in fp32.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from harness.peers.base import Peer, Sublayer, SublayerParams, TimedFn, Timing
from harness.peers.triton_interpreter import (
    device_properties,
    interpreted,
    prepare_interpreter,
    without_autotune_timing,
)
from harness.upstream.source_tree import SourceTree, SourceTreeError, load_file, placeholder_packages

__all__ = [
    "COMMIT_ENV_VAR",
    "KERNELS_FILE",
    "TREE_ENV_VAR",
    "TeTritonPeer",
    "WRAPPER_FILE",
    "load_te_mhc",
    "te_tree",
]

WRAPPER_FILE = Path("transformer_engine/pytorch/triton/mhc.py")
KERNELS_FILE = Path("transformer_engine/common/triton/mhc.py")
TREE_ENV_VAR = "MHC_TRANSFORMER_ENGINE"
COMMIT_ENV_VAR = "MHC_TRANSFORMER_ENGINE_COMMIT"
"""The tree's commit when it is not a git checkout (a `git archive`)."""
_PACKAGES = (
    "transformer_engine",
    "transformer_engine.common",
    "transformer_engine.common.triton",
    "transformer_engine.pytorch",
    "transformer_engine.pytorch.triton",
    "transformer_engine.pytorch.cpp_extensions",
)


def te_tree(path: Path | str) -> SourceTree:
    """The TE tree at `path`, checked (`SourceTreeError` naming what is missing)."""
    return SourceTree(
        option="--transformer-engine",
        path=Path(path).resolve(),
        files=(WRAPPER_FILE, KERNELS_FILE),
        commit_env=COMMIT_ENV_VAR,
    ).check()


def _extension_placeholder() -> ModuleType:
    """`transformer_engine.pytorch.cpp_extensions.gemm` with a `general_gemm` that says it is not there."""
    gemm: Any = ModuleType("transformer_engine.pytorch.cpp_extensions.gemm")

    def general_gemm(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "TransformerEngine's compiled extension (general_gemm, cuBLAS) is not loaded: the mHC "
            "files run from a source tree; pass norm_weight so that the projection backward runs its "
            "Triton kernel"
        )

    gemm.general_gemm = general_gemm
    return gemm


def _no_tma(x: torch.Tensor) -> bool:  # noqa: ARG001 - the wrapper's signature
    """TMA descriptors need a GPU: under the interpreter the kernels take their plain-load path."""
    return False


@cache
def load_te_mhc(tree: Path | None) -> ModuleType:
    """TE's `transformer_engine.pytorch.triton.mhc`: from `tree` (see the module docstring), else the
    installed package. Loaded once per tree."""
    if tree is None:
        return importlib.import_module("transformer_engine.pytorch.triton.mhc")
    src = te_tree(tree)
    with placeholder_packages(_PACKAGES, [_extension_placeholder()]):
        kernels = load_file("transformer_engine.common.triton.mhc", src.path / KERNELS_FILE)
        wrapper = load_file("transformer_engine.pytorch.triton.mhc", src.path / WRAPPER_FILE)
    if interpreted():
        without_autotune_timing(kernels)
        wrapper._support_tma = _no_tma  # type: ignore[attr-defined]  # the tree's module, loaded from its file
    return wrapper


def _default_tree() -> Path | None:
    value = os.environ.get(TREE_ENV_VAR)
    return Path(value) if value else None


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@dataclass(frozen=True, kw_only=True)
class TeTritonPeer(Peer):
    """TransformerEngine's Triton mHC (see the module docstring)."""

    tree: Path | None = field(default_factory=_default_tree)
    """A TE source tree (default `$MHC_TRANSFORMER_ENGINE`); None: the installed package (GPU)."""
    name: str = "te_triton"
    description: str = "TransformerEngine transformer_engine.pytorch.triton.mhc (Triton)"
    ops: frozenset[str] = frozenset({"coefficients", "aggregate", "mix", "sinkhorn", "layer"})
    dtypes: tuple[torch.dtype, ...] = (
        (torch.float32,) if not torch.cuda.is_available() else (torch.float32, torch.bfloat16)
    )
    """fp32 (interpreted: bf16 rounding inside the kernels would be NumPy's, not the GPU's); bf16 too on a GPU."""
    streams: tuple[int, ...] = (4,)
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "block_exit": "no learned block exit (TE's mHC ends at the last sublayer)",
            "coefficients": "RMS eps inside the square root and float32's machine eps (sqrt(ms + 1.19e-7)), not the "
            "model's 1e-6 (the option dtype_eps_inside_sqrt): seen only where the RMS is small "
            "(coefficients@rms1e-2)",
        }
    )
    timing: Timing | None = Timing(
        variant="megatron_main+dtype_eps_inside_sqrt+transposed_mix",
        ops=frozenset({"coefficients", "sinkhorn"}),
        gpu_only=True,
    )
    """Timed on a GPU only: under Triton's interpreter its times mean nothing."""

    def version(self) -> str | None:
        if self.tree is None:
            return _version("transformer-engine") or _version("transformer_engine")
        try:
            where = te_tree(self.tree).describe()
        except SourceTreeError:
            return None
        return f"{where} (interpreted)" if interpreted() else where

    def unavailable(self) -> str | None:
        if self.tree is None:
            if not torch.cuda.is_available():
                return (
                    f"no TE tree given (--transformer-engine PATH or ${TREE_ENV_VAR}: its two mHC files run "
                    "through Triton's interpreter) and no GPU for the installed package (transformer-engine "
                    "installs on NVIDIA machines only)"
                )
            if importlib.util.find_spec("transformer_engine") is None:
                return f"transformer-engine is not installed (pip install transformer-engine), and no ${TREE_ENV_VAR}"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (TE's mHC kernels are Triton; the peers extra has triton 3.9.0)"
        if self.tree is not None:
            try:
                te_tree(self.tree)
            except SourceTreeError as exc:
                return str(exc)
        why = prepare_interpreter()
        if why:
            return why
        try:
            load_te_mhc(self.tree)
        except Exception as exc:  # a tree whose files do not load is a reason, not a crash
            return f"TE's mHC failed to load from {self.tree or 'the installed package'}: {type(exc).__name__}: {exc}"
        return None

    def running(self):
        return device_properties()

    def source_tree(self) -> SourceTree:
        """The TE tree this peer loads (`ValueError` without one)."""
        if self.tree is None:
            raise ValueError("te_triton runs the installed package: no source tree")
        return te_tree(self.tree)

    # -- layout --------------------------------------------------------------------------------------------------

    @staticmethod
    def _dev(t: torch.Tensor) -> torch.Tensor:
        return t if interpreted() else t.to("cuda")

    def _streams_last(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, n, C] -> [T, 1, C, n]` on the peer's device."""
        t, n, c = x.shape
        return self._dev(x).permute(0, 2, 1).reshape(t, 1, c, n).contiguous()

    def _te(self) -> ModuleType:
        return load_te_mhc(self.tree)

    def _mappings(self, x: torch.Tensor, p: SublayerParams, iterations: int):
        """`(h_pre [T, n], h_post [T, n], h_res [T, n, n], x in TE's layout)` from TE's fused ops."""
        te, (t, n, c) = self._te(), x.shape
        xs = self._streams_last(x)
        phi = self._dev(p.weight).reshape(-1, n, c).transpose(1, 2).reshape(-1, n * c)
        norm_weight = (
            torch.ones(n * c, dtype=torch.float32, device=phi.device) if self.tree is not None else None
        )
        h, ms = te.mhc_fused_projection(xs.reshape(t, n * c), phi, use_tf32=False, norm_weight=norm_weight)
        alpha = self._dev(p.alphas())
        h_pre, h_post, logits = te.mhc_fused_scale(h, alpha, self._dev(p.bias).reshape(1, -1), ms, n)
        h_res = te.mhc_fused_sinkhorn(logits.reshape(t, 1, n, n), n, recompute_hist=True, iters=iterations)
        return h_pre.reshape(t, n), h_post.reshape(t, n), h_res.reshape(t, n, n), xs

    def _mix(
        self, h_res: torch.Tensor, xs: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """TE's `f @ H_post + x @ H_res` on `xs [T, 1, C, n]`: `[T, n, C]`."""
        t, _, c, n = xs.shape
        out = self._te().mhc_fused_expand_combine(
            self._dev(y).reshape(t, 1, c),
            None,
            self._dev(h_post).reshape(t, 1, n),
            xs,
            self._dev(h_res).reshape(t, 1, n, n),
            n,
            use_tf32=False,
        )
        return out.reshape(t, c, n).permute(0, 2, 1)

    # -- ops ------------------------------------------------------------------------------------------------------

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        h_pre, h_post, h_res, xs = self._mappings(x, params, iterations)
        agg = self._te().mhc_fused_aggregate(xs, h_pre.reshape(t, 1, n), n, use_tf32=False)
        home = x.device
        return {
            "h_pre": h_pre.to(home),
            "h_post": h_post.to(home),
            "h_res": h_res.to(home),
            "aggregate": agg.reshape(t, c).to(home),
        }

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        out = self._te().mhc_fused_aggregate(
            self._streams_last(x), self._dev(h_pre).reshape(t, 1, n), n, use_tf32=False
        )
        return out.reshape(t, c).to(x.device)

    def mix(self, h_res, residual, h_post, y):
        return self._mix(h_res, self._streams_last(residual), h_post, y).to(residual.device)

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        out = self._te().mhc_fused_sinkhorn(
            self._dev(logits).reshape(t, 1, n, n), n, recompute_hist=True, iters=iterations
        )
        return out.reshape(t, n, n).to(logits.device)

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        t, n, c = x.shape
        h = x
        for sub in (attn, mlp):
            h_pre, h_post, h_res, xs = self._mappings(h, sub.params, iterations)
            agg = self._te().mhc_fused_aggregate(xs, h_pre.reshape(t, 1, n), n, use_tf32=False)
            y = sub.f(agg.reshape(t, c).to(x.device))
            h = self._mix(h_res, xs, h_post, y)
        return h.to(x.device)

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`coefficients`: projection, scale, Sinkhorn and aggregate (`coefficients`); `sinkhorn`:
        `mhc_fused_sinkhorn`."""
        if op == "sinkhorn":
            return lambda d: (self.sinkhorn(d["logits"], iterations),)
        return self.timed_coefficients(iterations)
