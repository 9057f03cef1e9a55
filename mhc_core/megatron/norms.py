"""Sequence parallelism on megatron-core's local spec: a torch norm that takes it, and the spec with it.

megatron-core's local spec norms with `WrappedTorchNorm` (torch's `LayerNorm` / `RMSNorm`) when apex is absent,
and that refuses `sequence_parallel` (TE's and apex's norms take it), so on a machine without either, MoE with
TP > 1 (which megatron-core requires to run sequence parallel) cannot be built at all. A norm is per token:
under sequence parallelism each TP rank normalises its own `[s/TP, b, C]` slice with the same (replicated)
weight, and only its gradient needs the sum over the TP ranks, which megatron-core's finalize step does for every
parameter marked `sequence_parallel` (as TE and apex mark their norms' weights).

`SequenceParallelTorchNorm` is that norm; `with_sequence_parallel_norms(spec)` swaps it in for every
`WrappedTorchNorm` of a spec (layer, block, MTP block: any nesting of `ModuleSpec` and submodule dataclasses),
and `sequence_parallel_block_spec` gives a GPT chunk's block spec with it in the final norm too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = [
    "SequenceParallelTorchNorm",
    "sequence_parallel_block_spec",
    "sequence_parallel_specs",
    "with_sequence_parallel_norms",
]


class SequenceParallelTorchNorm:
    """torch's `LayerNorm` / `RMSNorm` (per `config.normalization`) as `WrappedTorchNorm` builds it, also under
    `config.sequence_parallel`, its parameters then marked `sequence_parallel` (their gradients summed over TP).

    Raises:
        ValueError: a normalization other than LayerNorm / RMSNorm, or an option torch's norms lack, named.
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(
                    f"SequenceParallelTorchNorm: config.{option}=True is not supported by torch's norms"
                )
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"SequenceParallelTorchNorm: config.normalization={config.normalization!r}; valid: "
                f"{', '.join(kinds)}"
            )
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        if getattr(config, "sequence_parallel", False):
            for p in norm.parameters():
                p.sequence_parallel = True  # megatron-core's marker on a Parameter
        return norm


def _is_wrapped_torch_norm(module: Any) -> bool:
    """megatron-core's `WrappedTorchNorm`, from the installed package or a source tree (matched by name)."""
    return isinstance(module, type) and module.__name__ == "WrappedTorchNorm"


def with_sequence_parallel_norms(spec: Any) -> Any:
    """`spec` with `SequenceParallelTorchNorm` for every `WrappedTorchNorm` in it (a class, a `ModuleSpec`, a
    submodules dataclass or a list of those; what is not a norm is returned as is, the same object when unchanged)."""
    if _is_wrapped_torch_norm(spec):
        return SequenceParallelTorchNorm
    if isinstance(spec, list | tuple):
        items = [with_sequence_parallel_norms(s) for s in spec]
        return spec if all(a is b for a, b in zip(items, spec, strict=True)) else type(spec)(items)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            new = with_sequence_parallel_norms(value)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


def sequence_parallel_block_spec(config: Any, layer_spec: Any, *, vp_stage: int | None = None) -> Any:
    """The `TransformerBlockSubmodules` of this chunk (its layer count as megatron-core builds it) from a local
    layer spec, every norm `SequenceParallelTorchNorm`, the final one included."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = with_sequence_parallel_norms(layer_spec)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelTorchNorm,
    )


def sequence_parallel_specs(
    config: Any, layer_spec: Any, mtp_block_spec: Any = None, *, vp_stage: int | None = None
) -> tuple[Any, Any]:
    """A GPT chunk's `(block spec, MTP block spec)` from a local layer spec under `config.sequence_parallel`,
    every norm `SequenceParallelTorchNorm` (the MTP block's too, None stays None); without sequence parallelism
    `(layer_spec, mtp_block_spec)` unchanged."""
    if not getattr(config, "sequence_parallel", False):
        return layer_spec, mtp_block_spec
    mtp = None if mtp_block_spec is None else with_sequence_parallel_norms(mtp_block_spec)
    return sequence_parallel_block_spec(config, layer_spec, vp_stage=vp_stage), mtp
