"""Provenance facts for meta files and perf records: versions, git commit, date.

Nothing here imports torch or megatron-core: versions come from installed distribution
metadata, and the CUDA version from the text of `torch/version.py`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata as md
import platform
import re
import subprocess
from pathlib import Path

__all__ = ["cuda_version", "git_commit", "package_versions", "utc_now"]

_PACKAGES = ("torch", "megatron-core", "numpy", "transformer-engine", "cuda-tile")


def utc_now() -> str:
    """The current UTC time, ISO 8601 with seconds (`2026-11-29T18:23:00+00:00`)."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


@functools.cache
def cuda_version() -> str | None:
    """CUDA version torch was built with (`torch.version.cuda`) without importing torch."""
    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == "torch/version.py":
            try:
                text = Path(dist.locate_file(f)).read_text(encoding="utf-8")
            except OSError:
                return None
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, flags=re.M)
            return m.group(1) if m else None
    return None


def package_versions() -> dict[str, str | None]:
    """Python, torch, megatron-core, numpy, transformer-engine, cuda-tile and CUDA versions (None: absent)."""
    return dict(_package_versions())


@functools.cache
def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["cuda"] = cuda_version()
    return out


def git_commit(cwd: str | Path | None = None) -> str | None:
    """`git rev-parse HEAD` in `cwd` (None outside a repository or without commits)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", sha) else None
