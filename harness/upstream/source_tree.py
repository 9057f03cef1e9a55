"""A peer's source tree given by path (`--transformer-engine PATH`, `--torchtitan PATH`): checked, named
by its commit, its files hashed, and its Python files loaded without the package around them.

Some peers' mHC is in no package that installs here: TransformerEngine's extension builds CUDA code, and
torchtitan's DeepSeek-V4 is in no release. Their mHC files are plain Python (Triton or PyTorch), so the
conformance suite reads them from a checkout the user points at. What is recorded from a tree names it by
commit and by the sha256 of the files that ran (`docs/conformance.md`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["SourceTree", "SourceTreeError", "git_commit", "load_file", "placeholder_packages"]


class SourceTreeError(ValueError):
    """A path that is not a usable tree of the named peer; the message names the option, the path and what
    is missing."""


def git_commit(tree: Path, env_var: str | None = None) -> str | None:
    """`git rev-parse HEAD` when `tree` is the top of a git checkout (not a folder inside another
    repository), else `$<env_var>`, else None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        out = None
    lines = out.stdout.split() if out is not None and out.returncode == 0 else []
    if len(lines) == 2 and Path(lines[0]).resolve() == Path(tree).resolve():
        return lines[1]
    return (os.environ.get(env_var) if env_var else None) or None


@dataclass(frozen=True, kw_only=True)
class SourceTree:
    """A checkout of one peer's repository: `option` (the CLI flag that named it), the `files` it must
    hold (relative paths) and `commit_env` (the commit of a tree that is not a git checkout)."""

    option: str
    path: Path
    files: tuple[Path, ...]
    commit_env: str

    def check(self) -> SourceTree:
        """`self` if the path is a directory holding every file, else `SourceTreeError`."""
        if not self.path.is_dir():
            raise SourceTreeError(f"{self.option} {self.path}: not a directory")
        missing = [str(f) for f in self.files if not (self.path / f).is_file()]
        if missing:
            raise SourceTreeError(f"{self.option} {self.path}: no {', '.join(missing)} under it")
        return self

    def commit(self) -> str | None:
        return git_commit(self.path, self.commit_env)

    def hashes(self) -> dict[str, str]:
        """sha256 of each of `files`."""
        return {str(f): hashlib.sha256((self.path / f).read_bytes()).hexdigest() for f in self.files}

    def describe(self) -> str:
        """`<commit[:12]>` or `tree <path> (no commit)`."""
        commit = self.commit()
        return commit[:12] if commit else f"tree {self.path} (no commit)"


def load_file(name: str, path: Path) -> ModuleType:
    """Execute the Python file `path` as the module `name` (registered in `sys.modules` under that name,
    as an import would) without importing the package it sits in."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SourceTreeError(f"{path}: not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextmanager
def placeholder_packages(names: Iterable[str], modules: Iterable[ModuleType] = ()) -> Iterator[None]:
    """Empty packages `names` (and the given `modules`) in `sys.modules` for the duration, so that a file
    loaded with `load_file` can run its absolute imports without the real package's `__init__`;
    afterwards every entry this added is removed again (a module loaded meanwhile keeps its references)."""
    added = []
    for name in names:
        if name not in sys.modules:
            pkg = ModuleType(name)
            pkg.__path__ = []  # a package: submodules may be registered under it
            sys.modules[name] = pkg
            added.append(name)
    for mod in modules:
        if mod.__name__ not in sys.modules:
            sys.modules[mod.__name__] = mod
            added.append(mod.__name__)
    before = set(sys.modules)
    try:
        yield
    finally:
        for name in added + sorted(set(sys.modules) - before):
            if name.split(".")[0] in {n.split(".")[0] for n in added}:
                sys.modules.pop(name, None)
