"""A megatron-core GPT's parameters by their single-stage names, across pipeline stages and TP shards.

Runs that must start from the same weights (a pipelined run and the single process, a Megatron-LM
tree and our integration) exchange one full state dict keyed by the names of the single-stage model:
decoder layers by their global number (`layer_number - 1`), TP-split parameters whole, an MTP depth's inner
layer under upstream dev's name (`mtp.layers.<k>.mtp_model_layer.`, `transformer_layer` in megatron-core 0.16),
dev's hybrid final norm (`decoder.final_norm.`) under the GPT block's `decoder.final_layernorm.`.
Each rank loads the slice it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["canonical_name", "full_names", "gather_full_state", "load_full_state", "shard"]

_MTP_INNER = (".transformer_layer.", ".mtp_model_layer.")
"""megatron-core 0.16's name of an MTP depth's inner layer, and upstream dev's (and 0.17+'s)."""


_HYBRID_FINAL_NORM = ("decoder.final_norm.", "decoder.final_layernorm.")
"""dev's `HybridStack` names its final norm `final_norm`; the GPT block (and ours) `final_layernorm`."""


def canonical_name(name: str) -> str:
    """`name` with an MTP depth's inner layer under dev's name and a hybrid stack's final norm under the GPT block's
    (every other name unchanged)."""
    old, new = _MTP_INNER
    if name.startswith("mtp.layers.") and old in name:
        return name.replace(old, new, 1)
    old, new = _HYBRID_FINAL_NORM
    if name.startswith(old):
        return new + name[len(old) :]
    return name


def full_names(chunk: Any) -> dict[str, str]:
    """Local parameter name -> name in the single-stage model (decoder layers by global number, an expert-parallel
    rank's local experts by their global index: `mlp.experts.local_experts.<j>` of a layer whose MoE holds experts
    `local_expert_indices`)."""
    layer_index = {}
    for i, layer in enumerate(chunk.decoder.layers):
        inner = getattr(layer, "inner_layer", None)  # a hybrid layer wraps its TransformerLayer
        mlp, where = (
            (inner.mlp, "inner_layer.mlp") if inner is not None else (getattr(layer, "mlp", None), "mlp")
        )
        experts = {
            f"{where}.experts.local_experts.{j}.": f"{where}.experts.local_experts.{g}."
            for j, g in enumerate(getattr(mlp, "local_expert_indices", ()))
        }
        layer_index[f"decoder.layers.{i}."] = (f"decoder.layers.{layer.layer_number - 1}.", experts)
    mapping = {}
    for local, _ in chunk.named_parameters():
        full = local
        for prefix, (global_prefix, experts) in layer_index.items():
            if local.startswith(prefix):
                rest = local[len(prefix) :]
                for local_expert, global_expert in experts.items():
                    if rest.startswith(local_expert):
                        rest = global_expert + rest[len(local_expert) :]
                        break
                full = global_prefix + rest
                break
        mapping[local] = canonical_name(full)
    return mapping


def _split(param: torch.Tensor, tp_size: int) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1


def shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of the whole tensor `full` that `param` holds on TP rank `tp_rank` of `tp_size`."""
    if _split(param, tp_size):
        return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]  # type: ignore[attr-defined]  # megatron's TP attribute
    return full


def load_full_state(
    chunks: Sequence[Any], full: dict[str, torch.Tensor], *, source: str | Path, tp_rank: int, tp_size: int
) -> None:
    """Copy each parameter's slice of `full` into `chunks`; `ValueError` naming `source` when a parameter is
    missing from it or its slice has another shape."""
    names = [full_names(c) for c in chunks]
    missing = sorted(
        {nm[local] for c, nm in zip(chunks, names, strict=True) for local, _ in c.named_parameters()}
        - set(full)
    )
    if missing:
        raise ValueError(
            f"{source}: {len(missing)} parameters of this model are not in it, e.g. {missing[:3]}; "
            f"it holds {len(full)} entries, e.g. {sorted(full)[:3]}"
        )
    with torch.no_grad():
        for chunk, nm in zip(chunks, names, strict=True):
            for local, p in chunk.named_parameters():
                value = shard(full[nm[local]], p, tp_rank, tp_size)
                if value.shape != p.shape:
                    raise ValueError(
                        f"{source}: {nm[local]} has shape {list(full[nm[local]].shape)}; its TP "
                        f"slice {tp_rank}/{tp_size} {list(value.shape)} does not fit {list(p.shape)}"
                    )
                p.copy_(value)


def gather_full_state(chunks: Sequence[Any], *, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor] | None:
    """The whole model's full state dict on global rank 0 (None elsewhere), gathered over every rank of the
    default process group (TP shards joined along their partition dim, data-parallel copies taken once)."""
    import torch.distributed as dist

    mine = {}
    for chunk in chunks:
        nm = full_names(chunk)
        for local, p in chunk.named_parameters():
            mine[nm[local]] = (
                tp_rank,
                p.partition_dim if _split(p, tp_size) else None,
                p.detach().float().clone(),
            )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    pieces: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    for rank_state in everyone:
        for name, (tp, dim, value) in rank_state.items():
            pieces.setdefault(name, {})[tp] = (dim, value)
    out = {}
    for name, by_tp in sorted(pieces.items()):
        dim = by_tp[min(by_tp)][0]
        out[name] = by_tp[0][1] if dim is None else torch.cat([by_tp[t][1] for t in sorted(by_tp)], dim=dim)
    return out
