"""An autotuned Triton kernel runs through the interpreter once its autotuner times nothing."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from harness.peers.triton_interpreter import interpreted, prepare_interpreter, without_autotune_timing

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not interpreted() or prepare_interpreter() is not None,
    reason="needs triton, no GPU, and TRITON_INTERPRET=1 before triton imports",
)

SOURCE = """
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 8})], key=["n"])
@triton.jit
def double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=mask), mask=mask)
"""


def _module(tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(SOURCE)  # triton.jit reads its kernel's source file
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(mod: types.ModuleType) -> torch.Tensor:
    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(x)
    mod.double[lambda meta: ((10 + meta["BLOCK"] - 1) // meta["BLOCK"],)](x, out, 10)
    return out


def test_an_autotuned_kernel_needs_the_timing_free_benchmarker(tmp_path):
    """Untouched, the autotuner asks for a driver the interpreter does not have; with the timing-free
    benchmarker it keeps its first configuration and the kernel computes the right values."""
    plain = _module(tmp_path, "mhc_autotuned_plain")
    with pytest.raises(RuntimeError, match="active drivers"):
        _run(plain)
    mod = _module(tmp_path, "mhc_autotuned_untimed")
    assert without_autotune_timing(mod) == 1
    assert torch.equal(_run(mod), 2 * torch.arange(10, dtype=torch.float32))
    assert mod.double.best_config.kwargs == {"BLOCK": 4}
