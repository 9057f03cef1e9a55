"""Megatron Lite's DeepSeek-V4 mHC as a peer, from a Megatron-LM tree that has it (`experimental/lite`, dev).

Megatron Lite is the slim training stack inside upstream dev's own tree (`experimental/lite/megatron/lite`),
with a DeepSeek-V4 model of its own (`model/deepseek_v4/lite/model.py`) whose hyper connection is not
megatron-core's `HyperConnectionModule`. What runs is the tree's own code, each file loaded on its own
(`load_file`; at dev d48bd6be they import torch only):

- `primitive/modules/attention/hca.py`: `HyperConnection` (RMS factor `1 / (||x|| / sqrt(n*C) + eps)`,
  the projection in the input's dtype, `split_sinkhorn`: `pre = sigmoid`, `post = 2 sigmoid`,
  Sinkhorn from `exp(Z - rowmax)` with `clamp(sum, eps)` rows then columns; the aggregate) and
  `HyperConnection.post` (the mix `post * y + comb @ residual`);
- `primitive/modules/attention/mhc.py`: `MultiHeadHyperConnectionHead` (the learned block exit);
- `primitive/parallel/mhc.py`: `expand_mhc_hidden_for_pipeline` (one stream to `hc_mult` copies) and
  `contract_mhc_hidden_for_pipeline` (the head, then the final norm).

The model's layer (`DeepseekV4Layer.forward`) imports Transformer Engine and cannot load on a CPU; its
composition is three calls per sublayer, made here in its order (`hc(x)`, the sublayer on the
aggregate, `HyperConnection.post(out, x, post, comb)`), so `layer` and `stack` run Lite's own ops as
its model chains them; the stack expands and contracts with Lite's own helpers (the final norm left
out: it follows the exit and is no part of mHC).

Parameter map (reference -> Lite, as its checkpoint mapping names DeepSeek-V4's `hc_attn_*` /
`hc_ffn_*`): `mapping_proj.weight` `[N, n*C]` -> `fn` (`[pre | post | res]` rows), `bias` -> `base`,
`(alpha_pre, alpha_post, alpha_res)` -> `scale[3]`; the exit -> `hc_fn / hc_base / hc_scale`. Layout
`[T, n, C]` -> `[1, T, n, C]`. It claims DeepSeek-V4's numerics (it loads DeepSeek-V4's weights unchanged):
`megatron_dev+eps_inside_sqrt+learned_exit`, the configuration transformers' DeepSeek-V4 conforms to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from harness.peers.base import Head, Peer, Sublayer, SublayerParams, bind_tensors
from harness.upstream.source_tree import SourceTree, SourceTreeError, load_file

__all__ = ["FILES", "MegatronLitePeer", "lite_tree", "load_lite"]

LITE = Path("experimental/lite/megatron/lite")
HCA_FILE = LITE / "primitive/modules/attention/hca.py"
HEAD_FILE = LITE / "primitive/modules/attention/mhc.py"
PIPELINE_FILE = LITE / "primitive/parallel/mhc.py"
MODEL_FILE = LITE / "model/deepseek_v4/lite/model.py"
"""Not loaded (it imports Transformer Engine); hashed with the others, as the composition it defines."""
FILES = (HCA_FILE, HEAD_FILE, PIPELINE_FILE, MODEL_FILE)
TREE_ENV_VAR = "MHC_MEGATRON_LM"
COMMIT_ENV_VAR = "MHC_MEGATRON_LM_COMMIT"
EPS = 1e-6
"""DeepSeek-V4's `hc_eps` (Lite's `HyperConnection` and head take one eps)."""


def lite_tree(path: Path | str) -> SourceTree:
    """The Megatron-LM tree at `path`, checked for Megatron Lite's DeepSeek-V4 mHC files (`SourceTreeError`
    naming what is missing: main and older dev trees have no `experimental/lite`)."""
    return SourceTree(
        option="--megatron-lm", path=Path(path).resolve(), files=FILES, commit_env=COMMIT_ENV_VAR
    ).check()


@cache
def load_lite(tree: Path) -> tuple[ModuleType, ModuleType, ModuleType]:
    """`(hca, head, pipeline)`: the tree's three mHC files as modules."""
    src = lite_tree(tree)
    return (
        load_file("mhc_suite_lite.hca", src.path / HCA_FILE),
        load_file("mhc_suite_lite.mhc_head", src.path / HEAD_FILE),
        load_file("mhc_suite_lite.parallel_mhc", src.path / PIPELINE_FILE),
    )


def _default_tree() -> Path | None:
    value = os.environ.get(TREE_ENV_VAR)
    return Path(value) if value else None


@dataclass(frozen=True, kw_only=True)
class MegatronLitePeer(Peer):
    """Megatron Lite's `HyperConnection` / `MultiHeadHyperConnectionHead` (see the module docstring)."""

    tree: Path | None = field(default_factory=_default_tree)
    """A Megatron-LM tree with `experimental/lite` (default `$MHC_MEGATRON_LM`)."""
    name: str = "megatron_lite"
    description: str = (
        "Megatron Lite (Megatron-LM experimental/lite) DeepSeek-V4 HyperConnection / "
        "MultiHeadHyperConnectionHead, its layer's composition (PyTorch)"
    )
    ops: frozenset[str] = frozenset({"coefficients", "mix", "sinkhorn", "layer", "block_exit", "stack"})
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.bfloat16)
    """fp64 and fp32, and bf16, the dtype it trains in, where its projection (`fn` cast to the input's dtype) and
    its Sinkhorn run in bf16."""
    claims: str | None = "megatron_dev+eps_inside_sqrt+learned_exit"
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "aggregate": "no aggregate with given h_pre (HyperConnection computes and consumes h_pre itself): checked "
            "through coefficients and layer",
        }
    )

    def version(self) -> str | None:
        if self.tree is None:
            return None
        try:
            return lite_tree(self.tree).describe()
        except SourceTreeError:
            return None

    def unavailable(self) -> str | None:
        if self.tree is None:
            return (
                f"no Megatron-LM tree given (--megatron-lm PATH or ${TREE_ENV_VAR}): a dev checkout with "
                "experimental/lite (megatron_lite[recorded] replays dev d48bd6be)"
            )
        try:
            load_lite(Path(self.tree))
        except SourceTreeError as exc:
            return str(exc)
        except ImportError as exc:
            return f"--megatron-lm {self.tree}: Megatron Lite's mHC files failed to import: {type(exc).__name__}: {exc}"
        return None

    def source_tree(self) -> SourceTree:
        """The tree this peer loads (its commit and the four files' hashes go into a recording)."""
        if self.tree is None:
            raise ValueError("megatron_lite: no source tree given")
        return lite_tree(self.tree)

    def _modules(self) -> tuple[ModuleType, ModuleType, ModuleType]:
        assert self.tree is not None
        return load_lite(Path(self.tree))

    def _hc(self, n: int, c: int, iterations: int, p: SublayerParams) -> nn.Module:
        hca = self._modules()[0]
        hc = hca.HyperConnection(c, n, iterations, EPS)
        return bind_tensors(hc, fn=p.weight, base=p.bias, scale=p.alphas())

    def _post(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        return self._modules()[0].HyperConnection.post(out, residual, post, comb)

    def _sublayer(self, x: torch.Tensor, sub: Sublayer, iterations: int) -> torch.Tensor:
        """One sublayer as `DeepseekV4Layer.forward` chains it: `x [1, T, n, C]` in and out."""
        _, t, n, c = x.shape
        y, post, comb = self._hc(n, c, iterations, sub.params)(x)
        out = sub.f(y.reshape(t, c)).reshape(y.shape)
        return self._post(out, x, post, comb)

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        y, post, comb = self._hc(n, c, iterations, params)(x[None])
        return {"h_post": post[0], "h_res": comb[0], "aggregate": y[0]}

    def mix(self, h_res, residual, h_post, y):
        return self._post(y[None], residual[None], h_post[None], h_res[None])[0]

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        hca = self._modules()[0]
        mixes = torch.cat([logits.new_zeros(t, 2 * n), logits.reshape(t, n * n)], dim=-1)[None]
        _, _, comb = hca.split_sinkhorn(
            mixes, logits.new_ones(3), logits.new_zeros((2 + n) * n), n, iterations, EPS
        )
        return comb[0]

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        h = x[None]
        for sub in (attn, mlp):
            h = self._sublayer(h, sub, iterations)
        return h[0]

    def _head(self, n: int, c: int, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> nn.Module:
        head = self._modules()[1].MultiHeadHyperConnectionHead(c, n, EPS)
        return bind_tensors(head, hc_fn=fn, hc_base=base, hc_scale=scale)

    def block_exit(self, x, head_fn, head_base, head_scale):
        t, n, c = x.shape
        return self._head(n, c, head_fn, head_base, head_scale)(x[None])[0]

    def stack(self, h, layers, head: Head, iterations):
        pipeline = self._modules()[2]
        n, c = layers[0][0].params.n, h.shape[-1]
        x = pipeline.expand_mhc_hidden_for_pipeline(h[None], hc_mult=n)
        for attn, mlp in layers:
            for sub in (attn, mlp):
                x = self._sublayer(x, sub, iterations)
        out = pipeline.contract_mhc_hidden_for_pipeline(
            x, norm=nn.Identity(), head=self._head(n, c, head.fn, head.base, head.scale)
        )
        return out[0]
