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
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=README.parent, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- code ---\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_reference_module_example_runs_with_the_shapes_it_states():
    """'Using the reference module' runs (its `my_sublayer` stood in by a linear map) and keeps `[s, b, C]`."""
    code = (
        "import torch\nmy_sublayer = torch.nn.Linear(256, 256)\n"
        + _example("Using the reference module")
        + "print(tuple(aggregated.shape), tuple(h_res.shape), tuple(x.shape), tuple(out.shape))\n"
    )
    assert _run(code).split("\n")[-2] == "(128, 2, 256) (128, 2, 4, 4) (128, 2, 1024) (128, 2, 256)"


def test_megatron_gpt_example_builds_an_mhc_model():
    """'mHC in a megatron-core GPT' builds an `MHCGPTModel` with upstream's mHC state-dict keys."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    code = (
        _example("mHC in a megatron-core GPT")
        + "keys = [k for k in model.state_dict() if 'hyper_connection.mapping_proj.weight' in k]\n"
        + "print(type(model).__name__, len(keys), keys[0])\n"
    )
    assert _run(code).split("\n")[-2] == (
        "MHCGPTModel 24 decoder.layers.0.self_attention_hyper_connection.mapping_proj.weight"
    )


def test_stability_example_reports_a_gain():
    """'Stability in your run' runs around a real mHC stack (its `model`, `train_step` and writers stood
    in) and reports a composite gain of 1 for mHC."""
    setup = (
        "import torch\nfrom mhc_core import HyperConnectionConfig, HyperConnectionModule, expand\n"
        "cfg = HyperConnectionConfig(hidden_size=16, num_residual_streams=4)\n"
        "model = torch.nn.ModuleList(HyperConnectionModule(cfg) for _ in range(4))\n"
        "def train_step(*args):\n"
        "    x = expand(torch.randn(8, 2, 16), 4)\n"
        "    for hc in model:\n"
        "        agg, h_res, h_post, residual = hc(x)\n"
        "        x = hc.post_residual_bda(h_res, residual, h_post, (torch.tanh(agg), None))\n"
        "    return x.sum()\n"
        "step, pipeline_group, tb_writer, wandb_run = 100, None, None, None\n"
    )
    code = (
        setup + _example("Stability in your run") + "print(report.sublayers, round(report.forward_gain, 4))\n"
    )
    assert _run(code).split("\n")[-2] == "4 1.0"
