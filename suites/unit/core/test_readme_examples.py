"""The README's Python examples run as written (each in a fresh interpreter: one sets up a process group)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def _example(heading: str) -> str:
    """The first ```python block after the line `## <heading>` in README.md."""
    text = README.read_text(encoding="utf-8")
    start = text.find(f"\n## {heading}\n")
    assert start >= 0, f"README.md has no section '## {heading}'"
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block is not None, f"README.md section '{heading}' has no python block"
    return block.group(1)


def _run(code: str) -> str:
    """Run `code` in a new interpreter from the repository root; its stdout (fails with its stderr)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=README.parent, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- code ---\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_reference_module_example_runs_with_the_shapes_it_states():
    """'Using the reference module' runs (its `my_sublayer` stood in by a linear map) and keeps `[s, b, C]`."""
    code = ("import torch\nmy_sublayer = torch.nn.Linear(256, 256)\n" + _example("Using the reference module")
            + "print(tuple(aggregated.shape), tuple(h_res.shape), tuple(x.shape), tuple(out.shape))\n")
    assert _run(code).split("\n")[-2] == "(128, 2, 256) (128, 2, 4, 4) (128, 2, 1024) (128, 2, 256)"


def test_megatron_gpt_example_builds_an_mhc_model():
    """'mHC in a megatron-core GPT' builds an `MHCGPTModel` with upstream's mHC state-dict keys."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    code = (_example("mHC in a megatron-core GPT")
            + "keys = [k for k in model.state_dict() if 'hyper_connection.mapping_proj.weight' in k]\n"
            + "print(type(model).__name__, len(keys), keys[0])\n")
    assert _run(code).split("\n")[-2] == (
        "MHCGPTModel 24 decoder.layers.0.self_attention_hyper_connection.mapping_proj.weight")
