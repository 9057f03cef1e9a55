"""Provenance facts for meta files and perf records: versions, git commit, date.

Nothing here imports torch or megatron-core: versions come from installed distribution
metadata, and the CUDA version from the text of `torch/version.py`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata as md
import os
import platform
import re
import subprocess
from pathlib import Path

__all__ = ["COMMIT_ENV", "cuda_version", "git_commit", "given_commit", "package_versions", "utc_now"]

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


COMMIT_ENV = "MHC_GIT_COMMIT"


def given_commit() -> str | None:
    """`$MHC_GIT_COMMIT` (None where unset or empty); a value that is not 7 to 64 hex digits is a ValueError."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given and not re.fullmatch(r"[0-9a-f]{7,64}", given):
        raise ValueError(f"{COMMIT_ENV}={given!r} is not a git commit (7 to 64 lowercase hex digits)")
    return given or None


def git_commit(cwd: str | Path | None = None) -> str | None:
    """`git rev-parse HEAD` in `cwd` (None outside a repository or without commits), or `$MHC_GIT_COMMIT`
    where it is set: a copy of the tree that ran (the device machine's) has a HEAD of its own, so the run
    command names the commit it was made from. A value that is not 7 to 64 hex digits is a ValueError."""
    given = given_commit()
    if given:
        return given
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", sha) else None
