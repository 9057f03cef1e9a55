"""The GPU sizes and kernel formulations that the cuTile tests, the layer benchmark and the precompiler share.

`ci/precompile_cutile.py` compiles ahead of time what the GPU parity tests
(`suites/unit/kernels_cutile/test_gpu_parity.py`) and the layer benchmark (`suites/perf/test_layer.py`)
launch, so both sides read them from here (a script never imports a test module).
"""

from __future__ import annotations

from mhc_core.kernels.cutile import tiling

__all__ = [
    "LAYER_SIZES",
    "MAPPING_BWD_TILES",
    "MAPPING_PARITY_SIZES",
    "PARITY_SIZES",
    "SINKHORN_FORMS",
    "STREAM_FORMS",
]

LAYER_SIZES = ((1024, 2, 4096, 32), (1024, 2, 7168, 56))
"""`(seq, batch, hidden, heads)` of the layer benchmark on a GPU (n = 4): the paper's and Megatron's hidden sizes."""

PARITY_SIZES = ((37, 96), (300, 1024))
"""`(T, C)` of the stream ops' GPU parity tests: a small odd size (partial tiles) and production tiles."""
MAPPING_PARITY_SIZES = ((37, 96), (1100, 1024))
"""`(T, C)` of the mapping's GPU parity tests."""

MAPPING_BWD_TILES = {
    "16x64": tiling.MappingTiles(tile_m=16, tile_k=64),
    "16x256": tiling.MappingTiles(tile_m=16, tile_k=256),
}
"""The mapping backward's sweep candidates: the spill-free 16 x 64 tile and the shipped H200 tuning's 16 x 256."""

SINKHORN_FORMS = {"per_element": {"per_element": True}}
"""The Sinkhorn formulations besides the default, as `SinkhornTiles` keywords (tile_b is each test's)."""

_SLICES, _TUPLE = tiling.StreamLayout.SLICES, tiling.StreamLayout.TUPLE
STREAM_FORMS = {
    "stream_loads": {
        "h_post_bda_fwd": tiling.StreamTiles(4, 256, per_stream=_TUPLE),
        "h_post_bda_bwd": tiling.StreamTiles(8, 64, per_stream=_TUPLE),
    },
    "loop_c_fwd": {
        "h_aggregate_fwd": tiling.StreamTiles(8, 256, per_stream=_SLICES, loop_c=True),
        "h_post_bda_fwd": tiling.StreamTiles(4, 256, per_stream=_TUPLE, loop_c=True),
    },
    "mma_fwd": {
        "h_aggregate_fwd": tiling.StreamTiles(8, 256, mma=True),
        "h_post_bda_fwd": tiling.StreamTiles(4, 256, per_stream=_SLICES, loop_c=True),
    },
    "tuned-occupancy": {
        "h_aggregate_fwd": tiling.StreamTiles(8, 256, loop_c=True, mma=True),
        "h_post_bda_bwd": tiling.StreamTiles(8, 64, per_stream=_TUPLE),
        "occupancy": {"h_aggregate_fwd_kernel": 4, "h_post_bda_bwd_kernel": 2},
    },
}
"""The stream kernels' other formulations, as `tiling.overridden` keywords, by test id."""
