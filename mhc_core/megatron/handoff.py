"""The single-pass handoff in a megatron-core model: the carrier's width and dtype from a config, the entry and
the exit of the block.

Legend: s sequence, b micro-batch, C hidden size, n residual streams, k handoff channels.

With `mhc_single_pass` every layer takes and returns the carrier `[s, b, n*C + k]` (`mhc_core.handoff`: the
streams, then the `H_pre` the next sublayer aggregates with), so the mix crosses layers, activation checkpoints
(full recompute, mHC recompute groups) and pipeline stages (PP, VPP chunks, standalone embedding and loss stages)
as the streams do. k = n when the mix has the streams' dtype, 2n for an fp32 mix behind bf16 / fp16 streams
(`deepseek_v41`'s coefficients are fp32): the P2P rule of `mhc_core.megatron.pipeline`.

`mhc_handoff_precision="pipeline_dtype"` rounds the mix to the pipeline dtype at every stage boundary instead
(k = n there), as upstream's `DSv41HybridStack` does: `send` / `receive` convert at the chunk's edges, so the
layers between always see the exact carrier.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mhc_core.handoff import HandoffPrecision, handoff_channels, pack, unpack
from mhc_core.ops.single_pass import entry_mix, exit_aggregate, mix_dtype

__all__ = [
    "boundary_width",
    "carrier_width",
    "enter",
    "handoff_mix_dtype",
    "is_single_pass",
    "leave",
    "receive",
    "rounded_at_boundaries",
    "send",
]


def is_single_pass(config: Any) -> bool:
    """mHC on, in the single-pass form."""
    return bool(
        getattr(config, "enable_mhc_connections", False) and getattr(config, "mhc_single_pass", False)
    )


def handoff_mix_dtype(config: Any, streams_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the H_pre handed on beside `streams_dtype` streams (fp32 under `fp32_coefficients`)."""
    return mix_dtype(config.mhc_numerics, streams_dtype)


def carrier_width(config: Any, streams_dtype: torch.dtype) -> int:
    """`n*C + k`: the width of the carrier of `streams_dtype` streams."""
    n = int(config.mhc_num_residual_streams)
    return n * config.hidden_size + handoff_channels(
        n, streams_dtype, handoff_mix_dtype(config, streams_dtype)
    )


def enter(config: Any, streams: Tensor) -> Tensor:
    """The block's entry: the expanded streams `[s, b, n*C]` with the identity mix (stream 0) behind them."""
    n = int(config.mhc_num_residual_streams)
    mix = entry_mix(
        tuple(streams.shape[:2]), n, dtype=handoff_mix_dtype(config, streams.dtype), device=streams.device
    )
    return pack(streams, mix)


def leave(config: Any, carrier: Tensor) -> Tensor:
    """The block's exit: the carrier's streams aggregated with its mix (the last sublayer's H_pre), `[s, b, C]`."""
    n = int(config.mhc_num_residual_streams)
    streams, mix = unpack(carrier, n, handoff_mix_dtype(config, carrier.dtype))
    return exit_aggregate(streams, mix, n)


def rounded_at_boundaries(config: Any) -> bool:
    """`mhc_handoff_precision="pipeline_dtype"`: the mix is rounded to the pipeline dtype between stages."""
    return (
        HandoffPrecision(getattr(config, "mhc_handoff_precision", HandoffPrecision.EXACT))
        == HandoffPrecision.PIPELINE_DTYPE
    )


def boundary_width(config: Any, streams_dtype: torch.dtype) -> int:
    """The carrier's width on a stage boundary: `carrier_width`, or `n*C + n` where the mix is rounded there."""
    if rounded_at_boundaries(config):
        return int(config.mhc_num_residual_streams) * (config.hidden_size + 1)
    return carrier_width(config, streams_dtype)


def send(config: Any, carrier: Tensor) -> Tensor:
    """A chunk's outgoing carrier as it crosses the boundary (the mix rounded to the streams' dtype under
    `pipeline_dtype`; else unchanged)."""
    if not rounded_at_boundaries(config):
        return carrier
    n = int(config.mhc_num_residual_streams)
    streams, mix = unpack(carrier, n, handoff_mix_dtype(config, carrier.dtype))
    return pack(streams, mix.to(carrier.dtype))


def receive(config: Any, boundary: Tensor) -> Tensor:
    """The inverse of `send` on the receiving chunk: the carrier its layers read."""
    if not rounded_at_boundaries(config):
        return boundary
    n = int(config.mhc_num_residual_streams)
    streams, mix = unpack(boundary, n, boundary.dtype)
    return pack(streams, mix.to(handoff_mix_dtype(config, boundary.dtype)))
