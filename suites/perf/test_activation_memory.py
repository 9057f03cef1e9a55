"""Activation memory of one layer with mHC, at n = 1 and n = 4, with and without mHC recompute, beside its count.

The layer is `test_layer.Layer` (plain torch: pre-norm attention + GELU MLP, an mHC connection around each
sublayer; with recompute, the layer is one `mhc_core.recompute.StreamRecompute` group). Measured exactly on any
device (`suites.perf.memory.retained_bytes`: what the forward allocated and still holds, its graph included, the
recompute group's own saves too), for the mHC layer and for the same layer without mHC in one run; the difference
is set beside `mhc_core.analysis.activation_extra_bytes`, the least an implementation must keep. The forward's
time is the benchmark (for the record); the numbers are in `extra_info`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mhc_core.analysis import activation_extra_bytes
from suites.perf.memory import retained_bytes
from suites.perf.test_layer import DEVICE, DTYPE, Layer, LayerShape

pytestmark = pytest.mark.perf

SHAPE = LayerShape(seq=64, batch=2, hidden=256, heads=4)
"""A small layer: the counts are exact at any size, and scale with T and C as the model says."""


def _retained(shape: LayerShape, n: int | None, recompute: bool) -> tuple[int, Layer, torch.Tensor]:
    torch.manual_seed(0)
    layer = Layer(shape, n, recompute=recompute).to(DEVICE, DTYPE)
    width = (n or 1) * shape.hidden
    x = torch.randn(shape.seq, shape.batch, width, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return retained_bytes(lambda: layer(x)), layer, x


@pytest.mark.parametrize("recompute", [False, True], ids=["autograd", "mhc-recompute"])
@pytest.mark.parametrize("n", [1, 4], ids=lambda n: f"n{n}")
def test_activation_memory_per_layer(benchmark, n, recompute):
    """The bytes one forward keeps with mHC over the same layer without it: at least the analytic count."""
    shape = dataclasses.replace(SHAPE, n=n)
    mhc, layer, x = _retained(shape, n, recompute)
    plain, _, _ = _retained(shape, None, False)
    act_bytes = torch.empty((), dtype=DTYPE).element_size()
    tokens = shape.seq * shape.batch
    analytic = activation_extra_bytes(
        tokens=tokens, n=n, hidden=shape.hidden, act_bytes=act_bytes, recompute=recompute
    )
    extra = mhc - plain
    benchmark.group = "layer-activation-memory"
    benchmark.pedantic(lambda: layer(x), rounds=3, warmup_rounds=1, iterations=1)
    benchmark.extra_info.update(
        {
            "op": "layer",
            "direction": "fwd",
            "backend": "reference+recompute" if recompute else "reference",
            "device": DEVICE,
            "shape": shape.id,
            "retained_bytes": mhc,
            "plain_retained_bytes": plain,
            "extra_bytes": extra,
            "analytic_extra_bytes": analytic,
            "extra_over_analytic": extra / analytic,
            "retained_ratio": mhc / plain,
        }
    )
    assert extra >= analytic, (
        f"n={n} recompute={recompute}: keeps {extra} bytes over the plain layer, the "
        + (f"analytic least is {analytic}")
    )


@pytest.mark.parametrize("n", [1, 4], ids=lambda n: f"n{n}")
def test_mhc_recompute_keeps_one_state_per_layer(n):
    """With the layer one recompute group, the forward keeps at least one `[T, n*C]` state less than autograd
    (two sublayers: the second sublayer's input state is rebuilt, the anchor kept)."""
    shape = dataclasses.replace(SHAPE, n=n)
    kept, _, _ = _retained(shape, n, False)
    recomputed, _, _ = _retained(shape, n, True)
    state = shape.seq * shape.batch * n * shape.hidden * torch.empty((), dtype=DTYPE).element_size()
    assert kept - recomputed >= state, (
        f"autograd {kept} bytes, mHC recompute {recomputed}: saves less than {state}"
    )
