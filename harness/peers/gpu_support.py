"""What every GPU-only peer needs: why it cannot run here, its package's version, its inputs on the GPU."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util

import torch

__all__ = ["cuda", "no_gpu", "package_version"]


def no_gpu(package: str, module: str, pip: str) -> str | None:
    """None when a CUDA GPU is here and `module` of `package` imports, else why not (`pip`: how to install it)."""
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch.cuda.is_available() is False); {pip} runs on NVIDIA GPUs only"
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{package} is not installed ({pip})"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install is a reason, not a crash
        return f"{module} failed to import: {type(exc).__name__}: {exc}"
    return None


def package_version(dist: str) -> str | None:
    """The installed version of `dist`, or None."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cuda(t: torch.Tensor) -> torch.Tensor:
    """`t` on the GPU (the GPU peers' inputs; results go back to the inputs' device)."""
    return t.to("cuda")
