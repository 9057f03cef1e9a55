"""The `compiled` backend: torch.compile of a fused formulation of each mHC op (CPU and GPU).

Each op has the exact signature and contract of its reference in `mhc_core.ops` and is an
autograd function whose forward and backward are each one compiled function (Inductor: C++/OpenMP
on CPU, Triton on CUDA). What each one fuses, and the compile policy, are in `docs/kernels.md`.
"""

from __future__ import annotations

from mhc_core.kernels.compiled.aggregate import h_aggregate
from mhc_core.kernels.compiled.common import availability, compiled_cache_size
from mhc_core.kernels.compiled.mapping import mapping
from mhc_core.kernels.compiled.post_bda import h_post_bda
from mhc_core.kernels.compiled.pre import pre
from mhc_core.kernels.compiled.sinkhorn import sinkhorn

__all__ = ["availability", "compiled_cache_size", "h_aggregate", "h_post_bda", "mapping", "pre", "sinkhorn"]
