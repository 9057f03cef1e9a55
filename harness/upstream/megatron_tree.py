"""A Megatron-LM source tree as a subject under test: which tree, its branch, commit, and how to run it.

No megatron-core release contains mHC: upstream's is in a checkout of Megatron-LM's `main` or `dev`
(`--megatron-lm PATH` on `mhc-harness`, else `$MHC_MEGATRON_LM`). The conformance peers
(`harness.peers.megatron_lm`), the pp suite and the functional suite run the tree's code in
processes of their own with `tree_env`: the tree's `megatron` first on `PYTHONPATH`, ahead
of any installed megatron-core. Upstream imports triton (the `tree` extra installs it).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from harness.upstream.source_tree import git_commit

__all__ = [
    "COMMIT_ENV_VAR",
    "FUSED_FILE",
    "HC_FILE",
    "TREE_ENV_VAR",
    "Tree",
    "TreeError",
    "hashes",
    "tree_commit",
    "tree_env",
    "tree_flavor",
    "tree_under_test",
]

HC_FILE = Path("megatron/core/transformer/hyper_connection.py")
FUSED_FILE = Path("megatron/core/fusions/fused_mhc_kernels.py")
TREE_ENV_VAR = "MHC_MEGATRON_LM"
COMMIT_ENV_VAR = "MHC_MEGATRON_LM_COMMIT"
"""The tree's commit when it is not a git checkout (a `git archive` of a branch)."""
REPO_ROOT = Path(__file__).resolve().parents[1]


class TreeError(ValueError):
    """A path that is not a usable Megatron-LM tree; the message names it and what is missing."""


def tree_flavor(tree: Path) -> str:
    """`main` or `dev` from the tree's config fields; `TreeError` for a path that is not a
    Megatron-LM tree or a tree without mHC."""
    tree = Path(tree)
    if not tree.is_dir():
        raise TreeError(f"--megatron-lm {tree}: not a directory")
    if not (tree / "megatron" / "core" / "__init__.py").is_file():
        raise TreeError(
            f"--megatron-lm {tree}: not a Megatron-LM tree (no megatron/core/__init__.py under it)"
        )
    if not (tree / HC_FILE).is_file():
        raise TreeError(
            f"--megatron-lm {tree}: a Megatron-LM tree without mHC (no {HC_FILE}); mHC is on the "
            "main and dev branches since 2026-08"
        )
    config = (tree / "megatron/core/transformer/transformer_config.py").read_text(encoding="utf-8")
    if "enable_mhc_connections" in config:
        return "main"
    if "enable_hyper_connections" in config:
        return "dev"
    raise TreeError(
        f"--megatron-lm {tree}: {HC_FILE} exists but transformer_config.py has neither "
        "enable_mhc_connections (main) nor enable_hyper_connections (dev)"
    )


def hashes(tree: Path) -> dict[str, str]:
    """sha256 of the mHC source files of the tree (those that exist)."""
    return {
        str(f): hashlib.sha256((Path(tree) / f).read_bytes()).hexdigest()
        for f in (HC_FILE, FUSED_FILE)
        if (Path(tree) / f).is_file()
    }


def tree_commit(tree: Path) -> str | None:
    """`git rev-parse HEAD` when the tree is the top of a git checkout (not a folder inside another
    repository), else `$MHC_MEGATRON_LM_COMMIT`, else None."""
    return git_commit(tree, COMMIT_ENV_VAR)


def tree_env(tree: Path) -> dict[str, str]:
    """Environment additions for a process that runs the tree: its `megatron` first on `PYTHONPATH`,
    this repository next, and upstream's `@torch.compile` methods run eagerly (`TORCHDYNAMO_DISABLE`)."""
    path = [str(Path(tree).resolve()), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "TORCHDYNAMO_DISABLE": "1"}


@dataclass(frozen=True, kw_only=True)
class Tree:
    """A validated tree: where it is, its branch (`main` / `dev`), its commit if known."""

    path: Path
    flavor: str
    commit: str | None

    @property
    def label(self) -> str:
        """`dev@d48bd6be0a85`, or `dev tree at PATH` without a commit."""
        return f"{self.flavor}@{self.commit[:12]}" if self.commit else f"{self.flavor} tree at {self.path}"


@cache
def _import_error(tree: Path, python: str) -> str | None:
    code = (
        "import megatron.core, megatron.core.transformer.hyper_connection; import sys; "
        f"assert megatron.core.__file__.startswith({str(tree)!r}), megatron.core.__file__"
    )
    env = {**os.environ, **tree_env(tree)}
    proc = subprocess.run(
        [python, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    if proc.returncode == 0:
        return None
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


def tree_under_test(path: str | Path | None = None, *, python: str | None = None) -> Tree | None:
    """The tree named by `path` (else `$MHC_MEGATRON_LM`), validated and imported once in a subprocess of
    `python` (default this interpreter); None when none is named. `TreeError` naming the path for a
    path that is not a tree, or for a tree that does not import here (with the import error and the Python)."""
    raw = path if path is not None else os.environ.get(TREE_ENV_VAR)
    if not raw:
        return None
    tree = Path(raw).resolve()
    flavor = tree_flavor(tree)
    python = python or sys.executable
    error = _import_error(tree, python)
    if error is not None:
        raise TreeError(
            f"--megatron-lm {tree}: its megatron.core does not import in {python}: {error}"
            + (
                " (upstream imports triton: install the tree extra, pip install -e '.[tree]')"
                if "triton" in error
                else ""
            )
        )
    return Tree(path=tree, flavor=flavor, commit=tree_commit(tree))
