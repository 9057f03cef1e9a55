"""The lint env's type check (mypy, configured in pyproject.toml) sees the GPU-only code paths: an import of a name
its module does not define, inside a function that returns early without a GPU, fails it, and the same function
importing the name from where it is defined passes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

GPU_ONLY = '''import torch


def te_rows():
    """Runs only on a GPU: no CPU test reaches the import."""
    if not torch.cuda.is_available():
        return None
    from {module} import TeTritonPeer

    return TeTritonPeer()
'''


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (harness[test] has it)"
)
def test_mypy_fails_a_missing_name_in_a_gpu_only_function(tmp_path):
    """`from harness.peers.gpu import TeTritonPeer` (the class lives in harness.peers.te_triton) in a GPU-only
    function fails the check naming the module and the name; the right module passes."""
    results = {}
    for module in ("harness.peers.gpu", "harness.peers.te_triton"):
        planted = tmp_path / module.rsplit(".", 1)[1] / "planted.py"
        planted.parent.mkdir()
        planted.write_text(GPU_ONLY.format(module=module), encoding="utf-8")
        # The lint env's cache (the repository's .mypy_cache) where it ran first: seconds instead of a minute.
        results[module] = subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--cache-dir",
                str(REPO / ".mypy_cache"),
                "--no-error-summary",
                str(planted),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    wrong, right = results["harness.peers.gpu"], results["harness.peers.te_triton"]
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert 'Module "harness.peers.gpu" has no attribute "TeTritonPeer"  [attr-defined]' in wrong.stdout, (
        wrong.stdout
    )
    assert right.returncode == 0, right.stdout + right.stderr
