"""Upstream Megatron-LM's mHC, from a source tree the user points at (`--megatron-lm PATH`).

No megatron-core release contains mHC, so the code under test is a checkout's
`megatron/core/transformer/hyper_connection.py` (`main`: config fields
`enable_mhc_connections` / `mhc_num_residual_streams`; `dev`: `enable_hyper_connections` /
`num_residual_streams`, plus `megatron/core/fusions/fused_mhc_kernels.py` behind
`use_fused_mhc`). What runs is upstream's own `HyperConnectionModule`: `compute_mappings`,
`aggregate`, `fused_h_res_h_post_bda` and its `forward` for the layer; its Sinkhorn
(`SinkhornKnopp` on main, `native_sinkhorn` / `fused_sinkhorn` on dev); dev's
`learned_output_contract` for the block exit. Its parameters are replaced by the check's tensors,
so gradients reach them. Layout: `[T, n, C]` -> `[s = T, b = 1, n*C]`.

The tree's `megatron` package must be the one imported, so these peers run in a process of their own:
`harness.conformance.record_megatron_lm.tree_peers` records a tree's results with
`python -m harness.conformance.record_megatron_lm` in a subprocess and replays them
(`harness.conformance.replay`). Upstream imports triton; a Python
without it (the CPU CI's 3.11 env) cannot load the tree, and the error says so.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.peers.base import Peer, Sublayer, SublayerParams, TimedFn, Timing, timed_params
from harness.upstream.megatron_tree import FUSED_FILE, HC_FILE, TreeError, hashes, tree_flavor

__all__ = [
    "FUSED_FILE",
    "HC_FILE",
    "MegatronLMTreePeer",
    "TreeApi",
    "TreeError",
    "bind_params",
    "detect_api",
    "hashes",
    "load_tree",
    "make_peers",
    "tree_flavor",
]


_MAIN_SWITCH = "enable_mhc_connections"
"""Main's config switch (the other generations' is `enable_hyper_connections`)."""
_KNOPP = "SinkhornKnopp.apply(x, iters)"
"""Main's Sinkhorn entry point (the others': `native_sinkhorn(x, iters, eps)`)."""


@dataclass(frozen=True, kw_only=True)
class TreeApi:
    """What a tree's mHC module has (detected on the loaded module, not guessed from a branch name)."""

    config: str
    """The config switch: `enable_mhc_connections` (main's generation) or `enable_hyper_connections`."""
    mix: str
    """The module's method that mixes and adds the sublayer output: `fused_h_res_h_post_bda` or `h_res_h_post_bda`."""
    sinkhorn: str
    """The Sinkhorn entry point: `native_sinkhorn(x, iters, eps)` or `SinkhornKnopp.apply(x, iters)`."""
    learned_exit: bool
    """Whether it has `learned_output_contract`."""
    fused: str | None
    """Its `fused_mhc_kernels`: `torch backend on CPU` (`MHC_FORCE_BACKEND`), `cuTile only`, or None (none)."""

    @property
    def generation(self) -> str:
        """`main`, `dev` or `other` by the features above (main: `enable_mhc_connections`; dev: the switch
        `enable_hyper_connections`, `fused_h_res_h_post_bda` and a fused module with a torch backend)."""
        if self.config == _MAIN_SWITCH:
            return "main"
        if self.mix == "fused_h_res_h_post_bda" and self.fused == "torch backend on CPU":
            return "dev"
        return "other"

    def line(self) -> str:
        """One line: the generation and each feature."""
        return (
            f"API generation {self.generation}: config {self.config}, mix {self.mix}, Sinkhorn {self.sinkhorn}, "
            f"{'learned exit' if self.learned_exit else 'no learned exit'}, fused kernels: {self.fused or 'none'}"
        )


def detect_api(hc: Any) -> TreeApi:
    """The `TreeApi` of a loaded tree (`hc`: its `megatron.core.transformer.hyper_connection`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    config = _MAIN_SWITCH if _MAIN_SWITCH in fields else "enable_hyper_connections"
    module = hc.HyperConnectionModule
    mix = next((m for m in ("fused_h_res_h_post_bda", "h_res_h_post_bda") if hasattr(module, m)), None)
    if mix is None:
        raise TreeError(
            "the tree's HyperConnectionModule has neither fused_h_res_h_post_bda nor h_res_h_post_bda: "
            "an mHC API this adapter does not know"
        )
    sinkhorn = "native_sinkhorn(x, iters, eps)" if hasattr(hc, "native_sinkhorn") else _KNOPP
    fused = None
    try:
        import megatron.core.fusions.fused_mhc_kernels as kernels
    except ImportError:
        kernels = None
    if kernels is not None:
        fused = "torch backend on CPU" if hasattr(kernels, "_forced_backend") else "cuTile only"
    return TreeApi(
        config=config,
        mix=mix,
        sinkhorn=sinkhorn,
        learned_exit=hasattr(hc, "learned_output_contract"),
        fused=fused,
    )


def load_tree(tree: Path) -> Any:
    """Import the tree's `hyper_connection` module (the tree first on `sys.path`); `TreeError` when
    another `megatron` is already imported or the import fails."""
    tree = Path(tree).resolve()
    loaded = sys.modules.get("megatron")
    if loaded is not None:
        where = [str(p) for p in getattr(loaded, "__path__", [])] or [str(getattr(loaded, "__file__", ""))]
        if not any(w.startswith(str(tree)) for w in where):
            raise TreeError(
                f"--megatron-lm {tree}: this process already imported megatron from {where[0]}; the "
                "tree peers run in a process of their own (harness.conformance.record_megatron_lm)"
            )
        import megatron.core.transformer.hyper_connection as hc

        _without_nvtx()
        return hc
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # upstream's @torch.compile methods run eagerly
    sys.path.insert(0, str(tree))
    try:
        import megatron.core.transformer.hyper_connection as hc
    except Exception as exc:
        raise TreeError(
            f"--megatron-lm {tree}: its megatron.core failed to import in {sys.executable}: "
            f"{type(exc).__name__}: {exc} (upstream imports triton: use a Python that has it, "
            "e.g. .tox/compat/bin/python, with --megatron-lm-python)"
        ) from None
    _without_nvtx()
    return hc


def _without_nvtx() -> None:
    """Upstream's mHC ops open NVTX ranges, which torch's CPU wheel refuses: apply the `nvtx` CPU
    workaround (explicit, reversible, a no-op where torch has NVTX or CUDA; `mhc_core.megatron.cpu_support`)."""
    from mhc_core.megatron import cpu_support

    cpu_support.install(["nvtx"])


def bind_params(mod: Any, params: SublayerParams) -> None:
    """Point an upstream `HyperConnectionModule`'s mapping weight, alphas and bias (their parameters deleted)
    at `params`' tensors, so gradients reach those."""
    mod.mapping_proj.weight, mod.bias = params.weight, params.bias
    mod.alpha_pre, mod.alpha_post, mod.alpha_res = params.alpha_pre, params.alpha_post, params.alpha_res


@dataclass(frozen=True, kw_only=True)
class MegatronLMTreePeer(Peer):
    """Upstream's `HyperConnectionModule` from `tree` (see the module docstring)."""

    tree: Path
    api: TreeApi
    """What the loaded tree's module has (`detect_api`): every op reads it."""
    fused: bool = False
    commit: str | None = None
    ops: frozenset[str] = frozenset({"coefficients", "aggregate", "mix", "sinkhorn", "layer"})
    differences: dict[str, str] = field(default_factory=dict)

    def version(self) -> str | None:
        return self.commit

    def unavailable(self) -> str | None:
        if self.fused and self.api.fused == "cuTile only":
            import megatron.core.fusions.fused_mhc_kernels as kernels

            if not kernels.is_cutile_available():
                return (
                    "its fused_mhc_kernels has no torch backend in this API generation and needs cuda.tile "
                    "(cuTile) on a GPU: not installed here"
                )
        return None

    def _mix_method(self, mod: Any):
        return getattr(mod, self.api.mix)

    def _module(self, n: int, c: int, iterations: int, params: SublayerParams | None, dtype: torch.dtype):
        hc = load_tree(self.tree)
        from megatron.core.transformer.transformer_config import TransformerConfig

        names = (
            {"enable_mhc_connections": True, "mhc_num_residual_streams": n}
            if self.api.config == _MAIN_SWITCH
            else {"enable_hyper_connections": True, "num_residual_streams": n, "use_fused_mhc": self.fused}
        )
        config = TransformerConfig(
            num_layers=1,
            hidden_size=c,
            num_attention_heads=1,
            use_cpu_initialization=True,
            mhc_sinkhorn_iterations=iterations,
            recompute_granularity="selective",
            recompute_modules=["mhc"],
            **names,
        )
        mod = hc.HyperConnectionModule(config, layer_number=1).to(dtype)
        if params is not None:
            del mod.mapping_proj.weight, mod.alpha_pre, mod.alpha_post, mod.alpha_res, mod.bias
            bind_params(mod, params)
        return hc, mod

    def coefficients(self, x, params, iterations):
        t, n, c = x.shape
        _, mod = self._module(n, c, iterations, params, x.dtype)
        flat = x.reshape(t, 1, n * c)
        h_pre, h_post, h_res = mod.compute_mappings(flat)
        return {
            "h_pre": h_pre.reshape(t, n),
            "h_post": h_post.reshape(t, n),
            "h_res": h_res.reshape(t, n, n),
            "aggregate": mod.aggregate(flat, h_pre).reshape(t, c),
        }

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        _, mod = self._module(n, c, 1, None, x.dtype)
        return mod.aggregate(x.reshape(t, 1, n * c), h_pre.reshape(t, 1, n)).reshape(t, c)

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        _, mod = self._module(n, c, 1, None, residual.dtype)
        out = self._mix_method(mod)(
            h_res.reshape(t, 1, n, n),
            residual.reshape(t, 1, n * c),
            h_post.reshape(t, 1, n),
            (y.reshape(t, 1, c), None),
            0.0,
            False,
            False,
        )
        return out.reshape(t, n, c)

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        hc = load_tree(self.tree)
        x = logits.reshape(t, 1, n, n)
        if self.api.sinkhorn == _KNOPP:  # main's generation
            return hc.SinkhornKnopp.apply(x, iterations).reshape(t, n, n)
        if self.fused:
            from megatron.core.fusions.fused_mhc_kernels import fused_sinkhorn

            return fused_sinkhorn(x, iterations, 1e-6).reshape(t, n, n)
        return hc.native_sinkhorn(x, iterations, 1e-6).reshape(t, n, n)

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        t, n, c = x.shape
        h = x.reshape(t, 1, n * c)
        for sub in (attn, mlp):
            _, mod = self._module(n, c, iterations, sub.params, x.dtype)
            out = mod(h)
            aggregated, h_res, h_post = out[:3]
            residual = out[3] if len(out) == 4 else h  # dev returns its residual alias as a 4th output
            y = sub.f(aggregated.reshape(t, c)).reshape(t, 1, c)
            h = self._mix_method(mod)(h_res, residual, h_post, (y, None), 0.0, False, False)
        return h.reshape(t, n, c)

    def block_exit(self, x, head_fn, head_base, head_scale):
        t, n, c = x.shape
        hc = load_tree(self.tree)
        return hc.learned_output_contract(
            x.reshape(t, 1, n * c), head_fn, head_base, head_scale, n, 1e-6
        ).reshape(t, c)

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`coefficients`: `compute_mappings` + `aggregate`; `layer_mhc`: the module's forward and its mix
        (`api.mix`) for both sublayers, the sublayers the identity. Modules built once, parameters bound to the
        inputs' tensors on every call (gradients reach them). main's parameters are cast to the activation dtype,
        as Megatron's `Float16Module` holds them (its `x @ W^T` refuses mixed dtypes); dev keeps them in fp32, as
        its module does."""
        t_dtype = dtype if self.api.generation == "main" else torch.float32
        big = n * n + 2 * n
        zeros = SublayerParams(
            n=n,
            weight=torch.zeros(big, n * hidden, dtype=t_dtype),
            alpha_pre=torch.zeros(1, dtype=t_dtype),
            alpha_post=torch.zeros(1, dtype=t_dtype),
            alpha_res=torch.zeros(1, dtype=t_dtype),
            bias=torch.zeros(big, dtype=t_dtype),
        )
        mods = [
            self._module(n, hidden, iterations, zeros, dtype)[1] for _ in range(2 if op == "layer_mhc" else 1)
        ]

        def bind(d):
            for k, mod in enumerate(mods):
                bind_params(mod, timed_params(d, k, t_dtype))

        if op == "coefficients":

            def coefficients(d):
                bind(d)
                t = d["x"].shape[0]
                flat = d["x"].reshape(t, 1, n * hidden)
                h_pre, h_post, h_res = mods[0].compute_mappings(flat)
                return (
                    h_post.reshape(t, n),
                    h_res.reshape(t, n, n),
                    mods[0].aggregate(flat, h_pre).reshape(t, hidden),
                )

            return coefficients

        def layer_mhc(d):
            bind(d)
            t = d["x"].shape[0]
            h = d["x"].reshape(t, 1, n * hidden)
            for mod in mods:
                out = mod(h)
                aggregated, h_res, h_post = out[:3]
                residual = out[3] if len(out) == 4 else h  # dev returns its residual alias as a 4th output
                h = self._mix_method(mod)(h_res, residual, h_post, (aggregated, None), 0.0, False, False)
            return (h.reshape(t, n, hidden),)

        return layer_mhc


DEV_CLAIM = "megatron_dev+learned_exit"
"""What dev's module computes: its block exits through `learned_output_contract`."""


def make_peers(tree: Path, commit: str | None, label: str | None = None) -> list[MegatronLMTreePeer]:
    """The peers of a loaded tree by what its module has (`detect_api`): the module on its native ops, and with
    a fused module that module too. Named `megatron_lm[<label>]` / `megatron_lm[<label>,fused]`, the label
    the tree's provenance (a branch the caller names, else its commit, else its folder); the claim is that of
    its API generation (main: `megatron_main`; dev: `megatron_dev+learned_exit`; another: none)."""
    tree_flavor(tree)  # a path that is no tree with mHC is named before anything imports it
    api = detect_api(load_tree(tree))
    label = label or (commit[:12] if commit else Path(tree).resolve().name)
    base: dict[str, Any] = dict(tree=Path(tree), commit=commit, api=api)
    where = f"upstream Megatron-LM {label}"
    claim = {"main": "megatron_main", "dev": DEV_CLAIM}.get(api.generation)
    timed = {"main": "megatron_main", "dev": "megatron_dev"}.get(
        api.generation
    )  # the conformance matrix's verdict
    if timed is not None:
        base["timing"] = Timing(variant=timed, ops=frozenset({"coefficients", "layer_mhc"}))
    if api.config == _MAIN_SWITCH:
        return [
            MegatronLMTreePeer(
                name=f"megatron_lm[{label}]",
                description=f"{where}, HyperConnectionModule; {api.line()}",
                claims=claim,
                **base,
            )
        ]
    ops = frozenset(
        {
            "coefficients",
            "aggregate",
            "mix",
            "sinkhorn",
            "layer",
            *(("block_exit",) if api.learned_exit else ()),
        }
    )
    fp32 = (torch.float32,)  # its mapping upcasts to fp32 and casts the coefficients back
    peers = [
        MegatronLMTreePeer(
            name=f"megatron_lm[{label}]",
            description=f"{where}, HyperConnectionModule (native ops); {api.line()}",
            claims=claim,
            ops=ops,
            dtypes=fp32,
            **base,
        )
    ]
    if api.fused is not None:
        peers.append(
            MegatronLMTreePeer(
                name=f"megatron_lm[{label},fused]",
                description=f"{where}, use_fused_mhc (fused_mhc_kernels; {api.fused}); {api.line()}",
                claims=claim,
                fused=True,
                ops=ops,
                dtypes=fp32,
                **base,
            )
        )
    return peers
