"""mhc_core: reference mHC (Manifold-Constrained Hyper-Connections), importable without megatron-core.

Legend: T tokens, s sequence, b micro-batch, C hidden size, n residual streams, N = n*n + 2n.
`mhc_core.megatron` (the only part that imports megatron-core) is not imported here.
"""

from mhc_core.analysis import AmaxGain, amax_gain, bytes_moved
from mhc_core.config import HyperConnectionConfig
from mhc_core.contraction import LearnedContraction
from mhc_core.forms import ConnectionForm
from mhc_core.module import HyperConnectionModule, SinglePassMix
from mhc_core.ops import (
    contract,
    entry_mix,
    exit_aggregate,
    expand,
    h_aggregate,
    h_post_bda,
    learned_contract,
    mapping,
    single_pass_pre,
    sinkhorn,
)
from mhc_core.stack import run_stack
from mhc_core.variants import CONFIGURATIONS, VARIANTS, Variant, VariantSpec, get_variant

__version__ = "0.1.0"

__all__ = [
    "CONFIGURATIONS",
    "VARIANTS",
    "AmaxGain",
    "ConnectionForm",
    "HyperConnectionConfig",
    "HyperConnectionModule",
    "LearnedContraction",
    "SinglePassMix",
    "Variant",
    "VariantSpec",
    "amax_gain",
    "bytes_moved",
    "contract",
    "entry_mix",
    "exit_aggregate",
    "expand",
    "get_variant",
    "h_aggregate",
    "h_post_bda",
    "learned_contract",
    "mapping",
    "run_stack",
    "single_pass_pre",
    "sinkhorn",
]
