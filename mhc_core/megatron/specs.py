"""GPT layer specs with an `enable_mhc` switch (the role of upstream PR #4945's spec wiring).

`get_gpt_layer_local_spec(..., enable_mhc=False)` and
`get_gpt_layer_with_transformer_engine_spec(..., enable_mhc=False)` call megatron-core's builder
of the same name with every other argument passed through unchanged. Without the flag the stock
spec is returned as is; with it, the spec is rewritten by `to_mhc_layer_spec`: module
`HyperConnectionTransformerLayer`, submodules `HyperConnectionTransformerLayerSubmodules` with
`self_attention_hyper_connection` and `mlp_hyper_connection` = `HyperConnectionModule`
(`cross_attention_hyper_connection` stays `IdentityOp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mhc_core.megatron.compat import transformer_engine_available
from mhc_core.megatron.layer import HyperConnectionTransformerLayer, HyperConnectionTransformerLayerSubmodules
from mhc_core.module import HyperConnectionModule

__all__ = [
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "to_mhc_layer_spec",
]


def to_mhc_layer_spec(
    spec: ModuleSpec, hyper_connection: type | ModuleSpec = HyperConnectionModule
) -> ModuleSpec:
    """A copy of a `TransformerLayer` spec turned into a `HyperConnectionTransformerLayer` spec.

    Every stock submodule is kept; the self-attention and MLP hyper-connection slots get
    `hyper_connection`, the cross-attention slot stays `IdentityOp`.

    Raises:
        ValueError: `spec` is not a spec of exactly `TransformerLayer` with `TransformerLayerSubmodules`.
    """
    if not isinstance(spec, ModuleSpec) or spec.module is not TransformerLayer:
        got = spec.module if isinstance(spec, ModuleSpec) else spec
        raise ValueError(f"to_mhc_layer_spec: spec must be a ModuleSpec of TransformerLayer, got {got!r}")
    if not isinstance(spec.submodules, TransformerLayerSubmodules):
        raise ValueError(
            f"to_mhc_layer_spec: spec.submodules must be TransformerLayerSubmodules, got {type(spec.submodules).__name__}"
        )
    fields = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)}
    fields.update(
        self_attention_hyper_connection=hyper_connection,
        cross_attention_hyper_connection=IdentityOp,
        mlp_hyper_connection=hyper_connection,
    )
    return dataclasses.replace(
        spec,
        module=HyperConnectionTransformerLayer,
        submodules=HyperConnectionTransformerLayerSubmodules(**fields),
    )


def get_gpt_layer_local_spec(*args: Any, enable_mhc: bool = False, **kwargs: Any) -> ModuleSpec:
    """megatron-core's `get_gpt_layer_local_spec(*args, **kwargs)`, as an mHC spec when `enable_mhc`."""
    spec = gpt_layer_specs.get_gpt_layer_local_spec(*args, **kwargs)
    return to_mhc_layer_spec(spec) if enable_mhc else spec


def get_gpt_layer_with_transformer_engine_spec(
    *args: Any, enable_mhc: bool = False, **kwargs: Any
) -> ModuleSpec:
    """megatron-core's `get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)`, as an mHC spec
    when `enable_mhc`.

    Raises:
        ImportError: `transformer_engine` is not importable (it never installs on a CPU machine).
    """
    if not transformer_engine_available():
        raise ImportError(
            "get_gpt_layer_with_transformer_engine_spec needs transformer_engine, which is not "
            "importable here; use get_gpt_layer_local_spec (spec='local') instead"
        )
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)
    return to_mhc_layer_spec(spec) if enable_mhc else spec
