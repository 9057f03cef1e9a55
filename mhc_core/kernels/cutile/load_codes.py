"""The stream kernels' load codes (their `LOADS` constant), without `cuda.tile`: shared by the load
and store helpers (`stream_common.load_raw` / `store_raw`, which take a code apart) and
`tiling.load_code` (which builds it).

`LOADS = latency + NO_TMA * (not tma) + UNCHECKED * unchecked`: the DRAM-latency hint in the low four
bits (0: none, 1-10), then the two flags."""

from __future__ import annotations

__all__ = ["NO_TMA", "UNCHECKED"]

NO_TMA = 16
"""The streaming loads may not use TMA (`StreamTiles.tma` False: `ct.load(allow_tma=False)`)."""
UNCHECKED = 32
"""The streaming loads and stores skip the bounds check (`StreamTiles.unchecked` in a launch of whole
tiles: `ct.load` / `ct.store` with `check_bounds=False`, tileiras >= 13.4)."""
