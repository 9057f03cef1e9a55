"""The `compiled` backend: torch.compile of a fused formulation of each mHC op (CPU and GPU).

`COMPILED` is the backend (`mhc_core.ops.contract.Backend`): each op takes its checked call and is an autograd
function whose forward and backward are each one compiled function (Inductor: C++/OpenMP on CPU, Triton on
CUDA). What each one fuses, and the compile policy, are in `docs/kernels.md`. A Sinkhorn iterated in the logits'
own dtype (`input_dtype_sinkhorn`) has no fused form: `sinkhorn` and `pre` run the reference for it.
"""

from __future__ import annotations

import torch

from mhc_core.kernels.compiled import aggregate, mapping, post_bda, pre, sinkhorn
from mhc_core.kernels.compiled.common import availability, compiled_cache_size
from mhc_core.ops import AggregateCall, Backend, MappingCall, PostBdaCall, PreCall, SinkhornCall
from mhc_core.ops.pre import pre_reference
from mhc_core.ops.sinkhorn import sinkhorn_reference

__all__ = ["COMPILED", "CompiledBackend", "availability", "compiled_cache_size"]


class CompiledBackend:
    """torch.compile of the fused formulations (each method: its op module here)."""

    name = "compiled"

    def sinkhorn(self, call: SinkhornCall) -> torch.Tensor:
        return sinkhorn_reference(call) if call.spec.sinkhorn_in_input_dtype else sinkhorn.sinkhorn(call)

    def mapping(self, call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mapping.mapping(call)

    def h_aggregate(self, call: AggregateCall) -> torch.Tensor:
        return aggregate.h_aggregate(call)

    def h_post_bda(self, call: PostBdaCall) -> torch.Tensor:
        return post_bda.h_post_bda(call)

    def pre(self, call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if call.spec.sinkhorn_in_input_dtype:
            return pre_reference(call)
        return pre.pre(call)


COMPILED: Backend = CompiledBackend()
"""The compiled backend."""
