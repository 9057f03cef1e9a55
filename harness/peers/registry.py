"""Every peer the conformance suite knows, by name.

``default_peers`` is what ``mhc-harness conformance`` runs without ``--peer``: ``mhc_core``'s three
variants on the reference backend, Hugging Face DeepSeek-V4, lucidrains, the committed numbers of
upstream Megatron-LM ``main`` and ``dev``, the GPU peers (skipped with a reason on a machine without
one), the installed plugins (entry point group ``mhc_suite.peers``), the ``--peer-module`` peers and,
given ``megatron_lm`` (a source tree), that tree's own modules (:mod:`harness.peers.plugins`).
``mhc_core[<v>,compiled]`` (torch.compile: a compile per shape, minutes on CPU) runs when named.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.peers.base import Peer

__all__ = ["all_peers", "default_peers", "select"]


def all_peers(megatron_lm: Path | None = None, *, python: str | None = None,
              modules: Sequence[str] = ()) -> list[Peer]:
    """Every known peer (the tree peers only with ``megatron_lm``, recorded with ``python``; ``modules``:
    ``MODULE:NAME`` specs of the user's own peers)."""
    from harness.peers.triton_interpreter import prepare_interpreter

    prepare_interpreter()  # before a peer imports triton (see there); LigerPeer.unavailable() repeats its verdict
    from harness.peers.gpu import gpu_peers
    from harness.peers.hf_deepseek_v4 import HfDeepseekV4Peer
    from harness.peers.liger import LigerPeer
    from harness.peers.lucidrains import LucidrainsPeer
    from harness.peers.mhc_core_peer import mhc_core_peers
    from harness.peers.plugins import entry_point_peers, module_peers
    from harness.peers.recorded import recorded_peers

    peers: list[Peer] = [*mhc_core_peers(("reference", "compiled")), HfDeepseekV4Peer(), LucidrainsPeer(),
                         LigerPeer(),
                         *recorded_peers(), *gpu_peers(), *entry_point_peers(), *module_peers(modules)]
    names = [p.name for p in peers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"peer name(s) {twice} are taken twice (a plugin must not reuse a built-in name)")
    if megatron_lm is not None:
        from harness.peers.megatron_lm import tree_peers

        peers += tree_peers(megatron_lm, python=python)
    return peers


def default_peers(megatron_lm: Path | None = None, *, python: str | None = None,
                  modules: Sequence[str] = ()) -> list[Peer]:
    """The peers a plain ``mhc-harness conformance`` runs (see the module docstring)."""
    return [p for p in all_peers(megatron_lm, python=python, modules=modules) if not p.name.endswith(",compiled]")]


def select(names: list[str], megatron_lm: Path | None = None, *, python: str | None = None,
           modules: Sequence[str] = ()) -> list[Peer]:
    """The named peers, in the order given; ``ValueError`` listing the known names for an unknown one."""
    if not names:
        return default_peers(megatron_lm, python=python, modules=modules)
    known = {p.name: p for p in all_peers(megatron_lm, python=python, modules=modules)}
    unknown = [n for n in names if n not in known]
    if unknown:
        hint = "" if megatron_lm else " (the megatron_lm_tree peers need --megatron-lm PATH)"
        raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(known)}{hint}")
    return [known[n] for n in names]
