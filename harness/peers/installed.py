"""A file of an installed distribution (a serving engine's wheel), located, hashed and loaded on its own.

The serving engines ship their mHC inside packages that do not import on a CPU machine (sglang's
`__init__` pulls in its runtime, vLLM's its CUDA extension), but the mHC code is plain PyTorch and Triton
files. They are installed without their dependencies (`pip install --no-deps`, the project's
`harness/requirements-serving.txt`) and the adapters execute exactly those files (`harness.upstream.source_tree.load_file`),
named by the distribution's version and the files' sha256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["InstalledFiles", "stand_in"]


def stand_in(name: str, package: bool = False, **attrs: Any) -> ModuleType:
    """A module `name` holding `attrs`, standing in for one a loaded file imports (a package with `package`, so
    that submodules can be registered under it)."""
    mod = ModuleType(name)
    if package:
        mod.__path__ = []  # a package: submodules may be registered under it
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


@dataclass(frozen=True, kw_only=True)
class InstalledFiles:
    """`files` (paths inside the distribution `dist`, as its wheel lists them) of version `version`."""

    dist: str
    version: str
    files: tuple[str, ...]

    def installed_version(self) -> str | None:
        try:
            return md.version(self.dist)
        except md.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        """None when every file is installed, else why not (a skip reason naming the install command)."""
        have = self.installed_version()
        how = f"pip install --no-deps {self.dist}=={self.version} (harness/requirements-serving.txt)"
        if have is None:
            return f"{self.dist} is not installed ({how})"
        missing = [f for f in self.files if not self.path(f).is_file()]
        if missing:
            return f"{self.dist} {have} has no {', '.join(missing)} (this adapter is written against {self.version}: {how})"
        return None

    def path(self, file: str) -> Path:
        """Where `file` of the installed distribution lies (`PackageNotFoundError` when it is not installed)."""
        return Path(str(md.distribution(self.dist).locate_file(file)))

    def hashes(self) -> dict[str, str]:
        """sha256 of each file."""
        return {f: hashlib.sha256(self.path(f).read_bytes()).hexdigest() for f in self.files}

    def describe(self) -> str:
        """`<dist> <version>`."""
        return f"{self.dist} {self.installed_version()}"
