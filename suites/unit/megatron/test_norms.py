"""Sequence parallelism on the local spec: the torch norm that takes it and the spec walk that swaps it in."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from mhc_core.megatron.norms import SequenceParallelTorchNorm, with_sequence_parallel_norms


def _config(**kw):
    base = dict(
        normalization="LayerNorm",
        sequence_parallel=True,
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        memory_efficient_layer_norm=False,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_the_norm_is_torchs_with_its_parameters_marked_sequence_parallel(kind):
    """The same torch module WrappedTorchNorm builds (bitwise the same output), its parameters marked for the
    gradient sum over TP; without sequence parallelism nothing is marked."""
    norm = SequenceParallelTorchNorm(_config(normalization=kind), 8, eps=1e-5)
    torch.manual_seed(0)
    x = torch.randn(3, 2, 8)
    plain = getattr(torch.nn, kind)(8, eps=1e-5)
    assert type(norm) is type(plain) and torch.equal(norm(x), plain(x))
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    off = SequenceParallelTorchNorm(_config(normalization=kind, sequence_parallel=False), 8)
    assert not any(getattr(p, "sequence_parallel", False) for p in off.parameters())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"normalization": "L2Norm"}, "normalization='L2Norm'"),
        ({"persist_layer_norm": True}, "persist_layer_norm"),
    ],
)
def test_what_torchs_norms_lack_is_refused_naming_it(change, message):
    """An unsupported normalization or option is refused, naming it."""
    with pytest.raises(ValueError, match=message):
        SequenceParallelTorchNorm(_config(**change), 8)


def test_every_wrapped_torch_norm_of_a_moe_layer_spec_is_swapped():
    """The local MoE layer spec's norms (input, pre-MLP) become the sequence-parallel norm; nothing else changes."""
    stock = get_gpt_layer_local_spec(num_experts=4)
    swapped = with_sequence_parallel_norms(stock)

    def norms(spec):
        return [
            getattr(spec.submodules, f.name)
            for f in dataclasses.fields(spec.submodules)
            if getattr(spec.submodules, f.name) in (WrappedTorchNorm, SequenceParallelTorchNorm)
        ]

    assert norms(stock) and all(n is WrappedTorchNorm for n in norms(stock))
    assert len(norms(swapped)) == len(norms(stock)) and all(
        n is SequenceParallelTorchNorm for n in norms(swapped)
    )
    assert swapped.submodules.mlp is stock.submodules.mlp or swapped.submodules.mlp == stock.submodules.mlp
    assert with_sequence_parallel_norms(swapped) is swapped  # nothing left to swap: the same object
