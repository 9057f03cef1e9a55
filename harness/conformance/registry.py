"""Every peer the conformance suite knows, by name.

`default_peers` is what `mhc-harness conformance` runs without `--peer`: `mhc_core`'s three
variants on the reference backend, Hugging Face DeepSeek-V4, lucidrains, the `mhc` package, NeMo Automodel's
DeepSeek-V4, Liger-Kernel, TransformerEngine's Triton mHC, torchtitan's DeepSeek-V4 and Megatron Lite's (each
from a source tree, `transformer_engine` / `torchtitan` / `megatron_lm`, else skipped saying so), the serving
engines sglang and vLLM (forward only, from their installed wheels), MaxText (JAX, Python >= 3.12: the compat
env), the committed recordings (upstream Megatron-LM `main` and `dev`, Megatron Lite, TE, torchtitan), the
GPU-only peers (skipped with a reason on a machine without one: TileKernels, the engines' TileLang ops,
flashinfer), the installed plugins (entry point group `mhc_suite.peers`), the `--peer-module` peers and, given
`megatron_lm` (a source tree), that tree's own modules (`harness.peers.plugins`).
`mhc_core[<v>,compiled]` (torch.compile: a compile per shape, minutes on CPU) runs when named.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.conformance.replay import load_recording
from harness.peers.base import Peer
from harness.upstream.megatron_tree import TreeError, tree_flavor

__all__ = ["all_peers", "default_peers", "select", "tree_peers"]


def all_peers(
    megatron_lm: Path | None = None,
    *,
    python: str | None = None,
    modules: Sequence[str] = (),
    transformer_engine: Path | None = None,
    torchtitan: Path | None = None,
    megatron_lite: Path | None = None,
) -> list[Peer]:
    """Every known peer (the Megatron-LM tree peers only with `megatron_lm`, recorded with `python`;
    `modules`: `MODULE:NAME` specs of the user's own peers; `transformer_engine` / `torchtitan`: their
    source trees, default `$MHC_TRANSFORMER_ENGINE` / `$MHC_TORCHTITAN`; `megatron_lite`: the Megatron-LM tree
    Megatron Lite's peer loads, default `megatron_lm`, else `$MHC_MEGATRON_LM`)."""
    from harness.peers.triton_interpreter import prepare_interpreter

    prepare_interpreter()  # before a peer imports triton (see there); LigerPeer.unavailable() repeats its verdict
    from harness.conformance.replay import recorded_peers
    from harness.peers.gpu import gpu_peers
    from harness.peers.hf_deepseek_v4 import HfDeepseekV4Peer
    from harness.peers.liger import LigerPeer
    from harness.peers.lucidrains import LucidrainsPeer
    from harness.peers.maxtext import MaxTextPeer
    from harness.peers.megatron_lite import MegatronLitePeer
    from harness.peers.mhc_core_peer import mhc_core_peers, single_pass_peer
    from harness.peers.mhc_package import MhcPackagePeer
    from harness.peers.nemo_automodel import NemoAutomodelPeer
    from harness.peers.nemo_automodel_v41 import NemoAutomodelV41Peer
    from harness.peers.plugins import entry_point_peers, module_peers
    from harness.peers.sglang import SglangPeer, SglangTritonPeer
    from harness.peers.te_triton import TeTritonPeer, te_tree
    from harness.peers.torchtitan import TorchtitanPeer, torchtitan_tree
    from harness.peers.vllm import VllmPeer, VllmSinglePassPeer, VllmSinglePassTritonPeer, VllmTritonPeer

    # A tree named explicitly is checked here (SourceTreeError, a ValueError naming it: the CLI exits 2); one
    # from the environment is checked by the peer, whose row then says why it did not run.
    trees = {"tree": te_tree(transformer_engine).path} if transformer_engine is not None else {}
    titan = {"tree": torchtitan_tree(torchtitan).path} if torchtitan is not None else {}
    lite_tree = megatron_lite or megatron_lm
    lite = {"tree": Path(lite_tree).resolve()} if lite_tree is not None else {}

    peers: list[Peer] = [
        *mhc_core_peers(("reference", "compiled")),
        single_pass_peer(),
        HfDeepseekV4Peer(),
        LucidrainsPeer(),
        MhcPackagePeer(),
        NemoAutomodelPeer(),
        NemoAutomodelV41Peer(),
        LigerPeer(),
        TeTritonPeer(**trees),
        TorchtitanPeer(**titan),
        MegatronLitePeer(**lite),
        SglangPeer(),
        SglangTritonPeer(),
        VllmPeer(),
        VllmTritonPeer(),
        VllmSinglePassPeer(),
        VllmSinglePassTritonPeer(),
        MaxTextPeer(),
        *recorded_peers(),
        *gpu_peers(),
        *entry_point_peers(),
        *module_peers(modules),
    ]
    names = [p.name for p in peers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"peer name(s) {twice} are taken twice (a plugin must not reuse a built-in name)")
    if megatron_lm is not None:
        peers += tree_peers(megatron_lm, python=python)
    return peers


def default_peers(megatron_lm: Path | None = None, **kwargs: Any) -> list[Peer]:
    """The peers a plain `mhc-harness conformance` runs (see the module docstring; `kwargs`: as
    `all_peers`)."""
    return [p for p in all_peers(megatron_lm, **kwargs) if not p.name.endswith(",compiled]")]


def select(names: list[str], megatron_lm: Path | None = None, **kwargs: Any) -> list[Peer]:
    """The named peers, in the order given; `ValueError` listing the known names for an unknown one
    (`kwargs`: as `all_peers`)."""
    if not names:
        return default_peers(megatron_lm, **kwargs)
    known = {p.name: p for p in all_peers(megatron_lm, **kwargs)}
    unknown = [n for n in names if n not in known]
    if unknown:
        hint = "" if megatron_lm else " (the megatron_lm_tree peers need --megatron-lm PATH)"
        raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(known)}{hint}")
    return [known[n] for n in names]


def tree_peers(tree: Path, *, python: str | None = None, timeout_s: float = 900) -> list[Peer]:
    """Record `tree` in a subprocess (`python`, default this interpreter) and return its replayed peers,
    named `megatron_lm_tree[...]`; `TreeError` naming the tree when it cannot be recorded."""
    tree_flavor(tree)  # a bad path is named before anything runs
    with tempfile.TemporaryDirectory(prefix="mhc-mlm-") as tmp:
        out = Path(tmp) / "recording.json"
        cmd = [
            python or sys.executable,
            "-m",
            "harness.conformance.record_megatron_lm",
            "--megatron-lm",
            str(tree),
            "--out",
            str(out),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
            ),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            errors = [x.removeprefix("error: ") for x in lines if x.startswith("error: ")]
            raise TreeError(
                errors[-1]
                if errors
                else f"--megatron-lm {tree}: recording failed (exit {proc.returncode}): "
                + " | ".join(lines[-3:])
            )
        return list(load_recording(out, prefix="megatron_lm_tree"))
