"""torchtitan's DeepSeek-V4 mHC as a peer, from a torchtitan source tree (pure PyTorch, CPU).

The 0.3.0 wheel on the registry has no `models/deepseek_v4`; it is in a checkout (PR #3634), given with
`--torchtitan PATH` (else `$MHC_TORCHTITAN`). What runs is the tree's
`torchtitan/models/deepseek_v4/mhc.py`: `HcPre` (RMS norm, projection, `HcSplitSinkhorn`, the
aggregate), `HcPost` (the mix `post * x + comb^T @ residual`), `HcSplitSinkhorn` and `HcHead` (the
learned block exit), built through their own `Config(...).build()` on torchtitan's real base class
(`torchtitan.protocols.module.Module`, which imports `tyro` and `spmd_types`: the peers extra has
them). The file is loaded on its own (`load_file`), without
`models/deepseek_v4/__init__.py`, which imports the whole model (attention, MoE; at 99222f645 it also
imports a helper its base commit renamed).

Parameter map (reference -> torchtitan): `mapping_proj.weight` `[N, n*C]` -> `hc_fn` (the same
`[pre | post | res]` rows, stream-major columns), `bias` -> `hc_base`, the alphas -> `hc_scale [3]`;
the block exit's `head_fn / head_base / head_scale` -> `HcHead`'s `hc_fn / hc_base / hc_scale`.
Layout: `[T, n, C]` -> `[B = 1, L = T, n, C]`. Sinkhorn of given logits runs `HcSplitSinkhorn` with
zero pre / post logits, `hc_scale = 1` and `hc_base = 0` (`comb * 1 + 0` is exact). Its mHC computes
in fp32 (`x.float()`, `hc_fn.float()`): fp32 checks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from harness.peers.base import Peer, Sublayer, SublayerParams, bind_tensors
from harness.upstream.source_tree import SourceTree, SourceTreeError, load_file

__all__ = [
    "COMMIT_ENV_VAR",
    "MHC_FILE",
    "TREE_ENV_VAR",
    "TorchtitanPeer",
    "load_torchtitan_mhc",
    "torchtitan_tree",
]

MHC_FILE = Path("torchtitan/models/deepseek_v4/mhc.py")
BASE_FILE = Path("torchtitan/protocols/module.py")
TREE_ENV_VAR = "MHC_TORCHTITAN"
COMMIT_ENV_VAR = "MHC_TORCHTITAN_COMMIT"
"""The tree's commit when it is not a git checkout (a `git archive` of the PR's commit)."""
EPS = 1e-6
"""`eps` and `norm_eps` of its configs (DeepSeek-V4's `hc_eps` and `rms_norm_eps`)."""


def torchtitan_tree(path: Path | str) -> SourceTree:
    """The torchtitan tree at `path`, checked (`SourceTreeError` naming what is
    missing: a release without DeepSeek-V4 has no `models/deepseek_v4/mhc.py`)."""
    return SourceTree(
        option="--torchtitan",
        path=Path(path).resolve(),
        files=(MHC_FILE, BASE_FILE),
        commit_env=COMMIT_ENV_VAR,
    ).check()


@cache
def load_torchtitan_mhc(tree: Path) -> ModuleType:
    """The tree's `mhc.py` as a module, with the tree's `torchtitan` package first on `sys.path`;
    `SourceTreeError` when another `torchtitan` is already imported."""
    src = torchtitan_tree(tree)
    loaded = sys.modules.get("torchtitan")
    if loaded is not None:
        where = [str(p) for p in getattr(loaded, "__path__", [])]
        if not any(w.startswith(str(src.path)) for w in where):
            raise SourceTreeError(
                f"--torchtitan {src.path}: this process already imported torchtitan from "
                f"{where[0] if where else '?'}"
            )
    elif str(src.path) not in sys.path:
        sys.path.insert(0, str(src.path))
    import torchtitan.protocols.module  # noqa: F401 - the base class mhc.py imports, from the tree

    return load_file("torchtitan.models.deepseek_v4.mhc", src.path / MHC_FILE)


def _default_tree() -> Path | None:
    value = os.environ.get(TREE_ENV_VAR)
    return Path(value) if value else None


@dataclass(frozen=True, kw_only=True)
class TorchtitanPeer(Peer):
    """torchtitan's `HcPre` / `HcPost` / `HcSplitSinkhorn` / `HcHead` (see the module docstring)."""

    tree: Path | None = field(default_factory=_default_tree)
    """A torchtitan source tree with DeepSeek-V4 (default `$MHC_TORCHTITAN`)."""
    name: str = "torchtitan"
    description: str = (
        "torchtitan models/deepseek_v4/mhc.py HcPre / HcPost / HcSplitSinkhorn / HcHead (PyTorch)"
    )
    ops: frozenset[str] = frozenset({"coefficients", "mix", "sinkhorn", "layer", "block_exit"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "aggregate": "no aggregate with given h_pre (HcPre computes and consumes h_pre itself): checked through "
            "coefficients and layer",
            "coefficients": "RMS eps inside the square root (rsqrt(mean(x^2) + eps))",
            "sinkhorn": "exp(Z - rowmax), then (row, column) passes dividing by sum + eps: megatron_main's order with "
            "dev's additive guard, and no softmax start",
        }
    )

    def version(self) -> str | None:
        if self.tree is None:
            return None
        try:
            return torchtitan_tree(self.tree).describe()
        except SourceTreeError:
            return None

    def unavailable(self) -> str | None:
        if self.tree is None:
            return (
                f"no torchtitan tree given (--torchtitan PATH or ${TREE_ENV_VAR}; the 0.3.0 wheel has no "
                "models/deepseek_v4): a checkout of PR #3634"
            )
        try:
            load_torchtitan_mhc(Path(self.tree))
        except SourceTreeError as exc:
            return str(exc)
        except ImportError as exc:
            return (
                f"--torchtitan {self.tree}: its base class failed to import: {type(exc).__name__}: {exc} "
                "(torchtitan's protocols import tyro and spmd_types: the peers extra has them)"
            )
        return None

    def source_tree(self) -> SourceTree:
        """The torchtitan tree this peer loads."""
        if self.tree is None:
            raise ValueError("torchtitan: no source tree given")
        return torchtitan_tree(self.tree)

    def _mhc(self) -> ModuleType:
        return load_torchtitan_mhc(Path(self.tree))

    def _pre(self, n: int, c: int, iterations: int, p: SublayerParams):
        """An `HcPre` whose `hc_fn / hc_base / hc_scale` are the check's tensors (gradients reach them)."""
        pre = (
            self._mhc()
            .HcPre.Config(hc_mult=n, dim=c, sinkhorn_iters=iterations, eps=EPS, norm_eps=EPS)
            .build()
        )
        return bind_tensors(pre, hc_fn=p.weight, hc_base=p.bias, hc_scale=p.alphas())

    def _post(self, h_res, residual, h_post, y):
        post = self._mhc().HcPost.Config().build()
        return post(y[None], residual[None], h_post[None], h_res[None])[0]

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        y, post, comb = self._pre(n, c, iterations, params)(x[None])
        return {"h_post": post[0], "h_res": comb[0], "aggregate": y[0]}

    def mix(self, h_res, residual, h_post, y):
        return self._post(h_res, residual, h_post, y)

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        split = self._mhc().HcSplitSinkhorn.Config(hc_mult=n, sinkhorn_iters=iterations, eps=EPS).build()
        mixes = torch.cat([logits.new_zeros(t, 2 * n), logits.reshape(t, n * n)], dim=-1)[None]
        _, _, comb = split(mixes, logits.new_ones(3), logits.new_zeros((2 + n) * n))
        return comb[0]

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        t, n, c = x.shape
        h = x
        for sub in (attn, mlp):
            y, post, comb = self._pre(n, c, iterations, sub.params)(h[None])
            h = self._post(comb[0], h, post[0], sub.f(y[0]))
        return h

    def block_exit(self, x, head_fn, head_base, head_scale):
        t, n, c = x.shape
        head = self._mhc().HcHead.Config(hc_mult=n, dim=c, norm_eps=EPS, eps=EPS).build()
        return bind_tensors(head, hc_fn=head_fn, hc_base=head_base, hc_scale=head_scale)(x[None])[0]
