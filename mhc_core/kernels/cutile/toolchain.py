"""Find the cuTile compiler toolchain (`tileiras`, `ptxas`, `libnvvm`) and the environment to run it.

Search order (the one `cuda.tile` itself uses):
1. the pip wheels of `cuda-tile[tileiras]` (`nvidia-cuda-tileiras`, `nvidia-cuda-nvcc`,
   `nvidia-nvvm`), installed under `site-packages/nvidia/cu13/{bin,lib,nvvm}`;
2. `tileiras` on `PATH`;
3. `$CUDA_HOME/bin/tileiras` (a system CUDA Toolkit >= 13.1; Hopper needs >= 13.3).

`Toolchain.env()` returns the variables to export for a subprocess or CI step: `PATH` with the
toolchain's `bin` first, `CUDA_HOME` (the wheel root `.../nvidia/cu13` for the wheels) and
`LD_LIBRARY_PATH` with the directory of `libnvvm`. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Toolchain", "find_toolchain", "apply_env"]


@dataclass(frozen=True)
class Toolchain:
    """Where the compiler pieces are, and which search step found them."""

    tileiras: Path
    ptxas: Path | None
    libnvvm: Path | None
    cuda_home: Path | None
    source: str  # "pip wheels", "PATH" or "CUDA_HOME"

    @property
    def bin_dir(self) -> Path:
        return self.tileiras.parent

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A copy of `base` (default `os.environ`) with PATH, CUDA_HOME and LD_LIBRARY_PATH set."""
        env = dict(os.environ if base is None else base)
        path = env.get("PATH", "")
        env["PATH"] = str(self.bin_dir) + (os.pathsep + path if path else "")
        if self.cuda_home is not None:
            env["CUDA_HOME"] = str(self.cuda_home)
        if self.libnvvm is not None:
            ld = env.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = str(self.libnvvm.parent) + (os.pathsep + ld if ld else "")
        return env

    @functools.cached_property
    def version(self) -> str:
        """`13.4.92`-style release of `tileiras`, or `unknown`."""
        try:
            out = subprocess.run(
                [str(self.tileiras), "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        m = re.search(r"V(\d+\.\d+\.\d+)", out)
        return m.group(1) if m else "unknown"

    @property
    def release(self) -> tuple[int, ...]:
        """`(major, minor)` of `version` (`(0,)` when unknown), for comparisons with `(13, 4)`."""
        try:
            return tuple(int(p) for p in self.version.split(".")[:2])
        except ValueError:
            return (0,)


def _wheel_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    for loc in spec.submodule_search_locations:
        root = Path(loc) / "cu13"
        if (root / "bin" / "tileiras").is_file():
            return root
    return None


def _first(*candidates: Path) -> Path | None:
    return next((c for c in candidates if c.is_file()), None)


def _from_root(root: Path, source: str) -> Toolchain:
    libnvvm = _first(
        root / "lib" / "libnvvm.so.4", root / "nvvm" / "lib64" / "libnvvm.so", root / "lib64" / "libnvvm.so"
    )
    return Toolchain(
        tileiras=root / "bin" / "tileiras",
        ptxas=_first(root / "bin" / "ptxas"),
        libnvvm=libnvvm,
        cuda_home=root,
        source=source,
    )


@functools.cache
def find_toolchain() -> Toolchain | None:
    """The toolchain, or None when no `tileiras` is found (cached for the process)."""
    root = _wheel_root()
    if root is not None:
        return _from_root(root, "pip wheels")
    on_path = shutil.which("tileiras")
    if on_path:
        p = Path(on_path).resolve()
        return _from_root(p.parent.parent, "PATH")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "tileiras").is_file():
        return _from_root(Path(cuda_home), "CUDA_HOME")
    return None


def apply_env() -> Toolchain | None:
    """Export the toolchain's PATH / CUDA_HOME / LD_LIBRARY_PATH into this process; returns it."""
    tc = find_toolchain()
    if tc is not None:
        os.environ.update(
            {k: v for k, v in tc.env().items() if k in ("PATH", "CUDA_HOME", "LD_LIBRARY_PATH")}
        )
    return tc
