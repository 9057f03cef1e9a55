"""mHC on megatron-core: config, layer, block boundary, GPT model, specs, CPU support.

The only part of `mhc_core` that imports megatron-core; import it explicitly
(`import mhc_core.megatron`). Importing it changes nothing in megatron-core: the CPU workarounds
are applied only by `cpu_support.install()` / `cpu_support.cpu_support()`.
"""

from mhc_core.megatron import compat, cpu_support
from mhc_core.megatron.block import HyperConnectionTransformerBlock
from mhc_core.megatron.config import MHCTransformerConfig
from mhc_core.megatron.gpt import MHCGPTModel, build_gpt_model
from mhc_core.megatron.layer import HyperConnectionTransformerLayer, HyperConnectionTransformerLayerSubmodules
from mhc_core.megatron.specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    to_mhc_layer_spec,
)

__all__ = [
    "HyperConnectionTransformerBlock",
    "HyperConnectionTransformerLayer",
    "HyperConnectionTransformerLayerSubmodules",
    "MHCGPTModel",
    "MHCTransformerConfig",
    "build_gpt_model",
    "compat",
    "cpu_support",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "to_mhc_layer_spec",
]
