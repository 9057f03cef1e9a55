"""The rank processes' deferred `torch.compile` (`harness.training.deferred_compile`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.launch.runs import REPO_ROOT

_PROBE = """
import sys
import torch
from harness.training.deferred_compile import defer_compile
defer_compile()
import megatron.core.fusions.fused_bias_gelu as fbg
print("inductor after import", "torch._inductor.compile_fx" in sys.modules)
from harness.training.deferred_compile import deferred
print("deferred", fbg.bias_gelu.__code__ is deferred(print).__code__)
"""


def test_megatron_imports_without_inductor():
    """After `defer_compile()` importing megatron-core's fused functions leaves Inductor unimported, and
    its `jit_fuser` functions are the deferred wrappers."""
    pytest.importorskip("megatron.core")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["inductor after import False", "deferred True"], proc.stdout


def test_the_first_call_compiles_and_later_calls_reuse_it():
    """A deferred function is compiled at its first call (dynamo's counting backend sees one frame), computes
    what the function does, and is not compiled again."""
    from torch._dynamo.testing import CompileCounter

    from harness.training.deferred_compile import deferred

    def f(x):
        return torch.sin(x) * 2

    counter = CompileCounter()
    g = deferred(f, backend=counter)
    assert getattr(g, "__wrapped__", None) is f and counter.frame_count == 0
    x = torch.randn(5, dtype=torch.float64)
    assert torch.equal(g(x), torch.sin(x) * 2)
    assert torch.equal(g(x), torch.sin(x) * 2)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for two calls of one shape"


def test_modules_go_to_the_real_compile():
    """`torch.compile(module)` is not deferred: it returns torch's `OptimizedModule`; the decorator-factory
    form defers a function."""
    from harness.training import deferred_compile as dc

    assert type(dc._compile(torch.nn.Linear(2, 2))).__name__ == "OptimizedModule"

    def h(x):
        return x + 1

    assert getattr(dc._compile(dynamic=False)(h), "__wrapped__", None) is h
