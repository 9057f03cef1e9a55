"""The reference mHC path under CUDA-graph capture (megatron-core's `cuda_graph_impl`): no host sync
inside the capture, and a clear error where capture cannot work (GPU only)."""

from __future__ import annotations

import pytest
import torch

from mhc_core import HyperConnectionConfig, HyperConnectionModule
from mhc_core.recompute import _RngState
from mhc_core.testing import assert_close, tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph capture)")
C, N = 64, 4


def _step(hc: HyperConnectionModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One mHC sublayer (reference ops; `y + aggregated` stands in for the sublayer): `[s, b, n*C]`."""
    aggregated, h_res, h_post, residual = hc(x)
    return hc.post_residual_bda(h_res, residual, h_post, (y + aggregated, None))


@pytest.mark.parametrize("variant", ["paper", "megatron_main", "megatron_dev"])
def test_reference_module_captures_and_replays_the_eager_result(variant):
    """The reference forward, its Sinkhorn NaN scan included, captures; a replay on new inputs gives the eager result."""
    # fp32 tolerance, not bitwise: cuBLAS may pick another algorithm inside a capture.
    torch.manual_seed(0)
    hc = HyperConnectionModule(
        HyperConnectionConfig(hidden_size=C, num_residual_streams=N, variant=variant, init_gating_factor=0.5)
    ).cuda()
    x, y = torch.randn(8, 2, N * C, device="cuda"), torch.randn(8, 2, C, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        _step(hc, x, y)  # warm-up outside the capture, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = _step(hc, x, y)
    x.copy_(torch.randn_like(x))
    y.copy_(torch.randn_like(y))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        expected = _step(hc, x, y)
    assert_close(f"captured mHC step [{variant}]", captured, expected, tolerance(torch.float32, "fwd"))


def test_dropout_replay_state_refuses_a_capture():
    """Inside a capture, mHC recompute's dropout replay raises a RuntimeError naming the way out."""
    # (It needs the CUDA generator's state, which torch refuses to give out while capturing.)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA-graph capture.*hidden_dropout=0"):
        with torch.cuda.graph(graph):
            _RngState(torch.device("cuda", torch.cuda.current_device()))
