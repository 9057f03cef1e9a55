"""Reference mHC math (eager PyTorch, any device): one small module per op."""

from mhc_core.ops.aggregate import AggregateCall, h_aggregate
from mhc_core.ops.contract import REFERENCE, Backend
from mhc_core.ops.mapping import NORM_EPS, MappingCall, mapping, num_mapping_outputs
from mhc_core.ops.post_bda import PostBdaCall, apply_h_res, h_post_bda
from mhc_core.ops.pre import PreCall, pre
from mhc_core.ops.single_pass import entry_mix, exit_aggregate, mix_dtype, single_pass_pre
from mhc_core.ops.sinkhorn import SinkhornCall, sinkhorn, sinkhorn_iterate
from mhc_core.ops.streams import contract, expand, learned_contract

__all__ = [
    "NORM_EPS",
    "REFERENCE",
    "AggregateCall",
    "Backend",
    "MappingCall",
    "PostBdaCall",
    "PreCall",
    "SinkhornCall",
    "apply_h_res",
    "contract",
    "entry_mix",
    "exit_aggregate",
    "expand",
    "h_aggregate",
    "h_post_bda",
    "learned_contract",
    "mapping",
    "mix_dtype",
    "num_mapping_outputs",
    "pre",
    "single_pass_pre",
    "sinkhorn",
    "sinkhorn_iterate",
]
