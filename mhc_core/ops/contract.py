"""The contract of the mHC ops, written once: what a backend implements.

Each op's contract is its module in `mhc_core.ops`: the public entry with its typed signature and docstring (the
shapes), its checks, and its *call*, the checked arguments with the variant resolved (`SinkhornCall`,
`MappingCall`, `AggregateCall`, `PostBdaCall`, `PreCall`). The entry builds the call once and hands it to a
backend:

    ops.mapping(x, weight, a_pre, a_post, a_res, bias, n, variant, backend=COMPILED)
        -> MappingCall(...)                  checked, variant -> VariantSpec, once
        -> COMPILED.mapping(call)            the backend's method, called by symbol

A backend is an object with one method per op taking that op's call (`Backend`): the reference (`REFERENCE`,
the oracle), the compiled one (`mhc_core.kernels.compiled.COMPILED`), cuTile's bound to a runtime
(`mhc_core.kernels.cutile.CuTileBackend(runtime)`: the GPU, the lab's CPU emulator or launch recorder) and the
per-op dispatch over them (`mhc_core.kernels.dispatch.DISPATCH`). An argument added to an op is a field of its call
and a parameter of its entry (its module), read where a backend computes with it: no signature of a backend
changes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mhc_core.ops.aggregate import AggregateBackend, AggregateCall, h_aggregate_reference
from mhc_core.ops.mapping import MappingBackend, MappingCall, mapping_reference
from mhc_core.ops.post_bda import PostBdaBackend, PostBdaCall, h_post_bda_reference
from mhc_core.ops.pre import PreBackend, PreCall, pre_reference
from mhc_core.ops.sinkhorn import SinkhornBackend, SinkhornCall, sinkhorn_reference

__all__ = ["REFERENCE", "Backend", "ReferenceBackend"]


class Backend(SinkhornBackend, MappingBackend, AggregateBackend, PostBdaBackend, PreBackend, Protocol):
    """The five ops of a backend, each taking its checked call (shapes: the calls' fields and `mhc_core.ops`); each
    op's entry takes only its own op's part of it (`SinkhornBackend`, ...), declared beside the op."""

    name: str
    """`reference`, `compiled`, `cutile` or `dispatch`."""

    def sinkhorn(self, call: SinkhornCall) -> torch.Tensor:
        """`[..., n, n] -> [..., n, n]`."""
        ...

    def mapping(self, call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x [T, n*C] -> h_pre [T, n], h_post [T, n], h_res_logits [T, n, n]`."""
        ...

    def h_aggregate(self, call: AggregateCall) -> torch.Tensor:
        """`x [T, n, C], h_pre [T, n] -> [T, C]`."""
        ...

    def h_post_bda(self, call: PostBdaCall) -> torch.Tensor:
        """`-> [T, n, C]`."""
        ...

    def pre(self, call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x [T, n*C] -> aggregate [T, C], h_pre [T, n], h_post [T, n], h_res [T, n, n]`."""
        ...


class ReferenceBackend:
    """Eager PyTorch, any device: the oracle of every other backend (each method is its op module's
    `<op>_reference`)."""

    name = "reference"

    def sinkhorn(self, call: SinkhornCall) -> torch.Tensor:
        return sinkhorn_reference(call)

    def mapping(self, call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mapping_reference(call)

    def h_aggregate(self, call: AggregateCall) -> torch.Tensor:
        return h_aggregate_reference(call)

    def h_post_bda(self, call: PostBdaCall) -> torch.Tensor:
        return h_post_bda_reference(call)

    def pre(self, call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return pre_reference(call)


REFERENCE: Backend = ReferenceBackend()
"""The reference backend."""
