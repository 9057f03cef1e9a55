"""Peers from outside this package: a user's own mHC implementation under the same checks.

Two ways in, neither of which edits this package:

- `mhc-harness conformance --peer-module MODULE:NAME` (repeatable): `MODULE` is imported (the
  current directory first on `sys.path`, so a file next to where the command runs works) and
  `NAME` in it is a `Peer` instance, a `Peer` subclass that takes no
  arguments, or a function of no arguments returning one or a list of them;
- an installed distribution that declares an entry point in the group `mhc_suite.peers`
  (`[project.entry-points."mhc_suite.peers"] my_mhc = "my_pkg.my_mhc:MyPeer"`), loaded the same way
  on every run.

A module that does not import, a name it lacks, or an object that is not a peer is a
`PeerPluginError` naming the spec; `docs/conformance.md` has a complete example.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
from collections.abc import Iterable
from typing import Any

from harness.peers.base import Peer, PeerError

__all__ = ["ENTRY_POINT_GROUP", "PeerPluginError", "entry_point_peers", "load_peer_spec", "module_peers"]

ENTRY_POINT_GROUP = "mhc_suite.peers"


class PeerPluginError(PeerError, ValueError):
    """A `--peer-module` spec or an entry point that does not give a peer (a refused input: the CLI exits 2)."""


def _as_peers(obj: Any, where: str) -> list[Peer]:
    if isinstance(obj, type) and issubclass(obj, Peer):
        try:
            obj = obj()  # type: ignore[call-arg]  # a plugin's subclass may take none of Peer's arguments
        except TypeError as exc:
            raise PeerPluginError(
                f"{where}: the Peer subclass {obj.__name__} cannot be built without arguments "
                f"({exc}); export an instance or a function that returns one"
            ) from None
    elif callable(obj) and not isinstance(obj, Peer):
        try:
            obj = obj()
        except Exception as exc:
            raise PeerPluginError(f"{where}: calling it raised {type(exc).__name__}: {exc}") from None
    items = list(obj) if isinstance(obj, list | tuple) else [obj]
    bad = [type(i).__name__ for i in items if not isinstance(i, Peer)]
    if bad or not items:
        raise PeerPluginError(
            f"{where}: not a Peer (got {', '.join(bad) or 'an empty list'}); expected a "
            "harness.peers.base.Peer instance, a Peer subclass, or a function returning them"
        )
    return items


def load_peer_spec(spec: str) -> list[Peer]:
    """The peers named by `MODULE:NAME` (see the module docstring)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise PeerPluginError(f"--peer-module {spec!r}: expected MODULE:NAME, e.g. my_pkg.my_mhc:MyPeer")
    where = f"--peer-module {spec}"
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise PeerPluginError(
            f"{where}: module {module!r} failed to import in {sys.executable}: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(mod, name):
        public = sorted(n for n in vars(mod) if not n.startswith("_"))
        raise PeerPluginError(
            f"{where}: module {module!r} ({getattr(mod, '__file__', '?')}) has no {name!r}; it has "
            f"{', '.join(public[:12]) or 'nothing public'}"
        )
    return _as_peers(getattr(mod, name), where)


def module_peers(specs: Iterable[str]) -> list[Peer]:
    """Every peer of every `MODULE:NAME` in `specs`, in order."""
    return [p for spec in specs for p in load_peer_spec(spec)]


def entry_point_peers(group: str = ENTRY_POINT_GROUP) -> list[Peer]:
    """The peers of every installed entry point in `group`; a broken one is a PeerError naming it."""
    out: list[Peer] = []
    for ep in sorted(md.entry_points(group=group), key=lambda e: e.name):
        where = f"entry point {ep.name} = {ep.value} ({group})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise PeerPluginError(f"{where}: failed to load: {type(exc).__name__}: {exc}") from None
        out += _as_peers(obj, where)
    return out
