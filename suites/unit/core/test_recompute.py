"""`mhc_core.recompute.StreamRecompute`: states dropped in forward, rebuilt bitwise in backward."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from mhc_core import HyperConnectionConfig, HyperConnectionModule
from mhc_core.recompute import StreamRecompute

S, B, C, N = 6, 2, 8, 4


class Stack(nn.Module):
    """`depth` mHC sublayers around small MLPs; `group_size` sublayers per recompute group (0: off)."""

    def __init__(self, depth: int, variant: str = "megatron_main", dropout: float = 0.0):
        super().__init__()
        cfg = HyperConnectionConfig(hidden_size=C, num_residual_streams=N, variant=variant)
        self.hcs = nn.ModuleList(HyperConnectionModule(cfg) for _ in range(depth))
        self.fs = nn.ModuleList(nn.Linear(C, C) for _ in range(depth))
        self.dropout = dropout
        self.states: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, group_size: int = 0) -> torch.Tensor:
        self.states = []
        group = None
        for i, (hc, f) in enumerate(zip(self.hcs, self.fs, strict=True)):
            if group_size and i % group_size == 0:
                group = StreamRecompute(x)
            agg, h_res, h_post, res = hc(x) if group is None else _in(group, hc, x)
            y = _sublayer(f, agg) if group is None else _in(group, _sublayer, f, agg)
            if group is None:
                x = hc.post_residual_bda(h_res, res, h_post, (y, f.bias), self.dropout, self.training)
            else:
                with group.saving():
                    x = group.post_residual_bda(
                        hc, h_res, res, h_post, (y, f.bias), self.dropout, self.training
                    )
                if (i + 1) % group_size == 0 or i == len(self.hcs) - 1:
                    group.close()
                    group = None
            self.states.append(x)
        return x


def _sublayer(f: nn.Linear, agg: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(f(agg))


def _in(group: StreamRecompute, fn, *args):
    with group.saving():
        return fn(*args)


def _grads(model: Stack, x: torch.Tensor, group_size: int, seed: int = 0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = model(xi, group_size)
    out.backward(torch.ones_like(out).cumsum(-1) / out.shape[-1])
    return out.detach(), xi.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", ["megatron_main", "megatron_dev", "paper"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_gradients_are_bitwise_those_of_the_plain_run(variant, group_size):
    """Output, input gradient and every parameter gradient equal the run without recompute, bitwise."""
    torch.manual_seed(0)
    model = Stack(4, variant)
    x = torch.randn(S, B, N * C)
    ref, got = _grads(model, x, 0), _grads(model, x, group_size)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for i, (a, b) in enumerate(zip(ref[2], got[2], strict=True)):
        assert torch.equal(a, b), f"param {i}: max abs diff {(a - b).abs().max().item():.3e}"


def test_dropout_masks_are_replayed():
    """With hidden dropout in training, the rebuilt states use the forward's masks: gradients equal bitwise."""
    torch.manual_seed(0)
    model = Stack(3, dropout=0.3).train()
    x = torch.randn(S, B, N * C)
    ref, got = _grads(model, x, 0, seed=5), _grads(model, x, 3, seed=5)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(ref[2], got[2], strict=True))


@pytest.mark.parametrize("group_size", [0, 2])
def test_states_inside_a_group_are_freed_after_forward(group_size):
    """Without recompute autograd keeps every state; with groups of 2 only each group's last state survives."""
    torch.manual_seed(0)
    model = Stack(4)
    x = torch.randn(S, B, N * C, requires_grad=True)
    out = model(x, group_size)
    refs = [StorageWeakRef(s.untyped_storage()) for s in model.states[:-1]]
    model.states = []
    gc.collect()
    alive = [not r.expired() for r in refs]
    # states 1..3 (the output, state 4, is held by `out`); with groups of 2 state 2 anchors the second group
    assert alive == ([True, True, True] if group_size == 0 else [False, True, False])
    out.sum().backward()


def test_residual_must_be_the_newest_state():
    """Extending a group from a tensor that is not its newest state is a ValueError naming the rule."""
    torch.manual_seed(0)
    hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=C, num_residual_streams=N))
    x = torch.randn(S, B, N * C)
    group = StreamRecompute(x)
    agg, h_res, h_post, res = hc(x.clone())
    with pytest.raises(ValueError, match="not the group's newest state"):
        group.post_residual_bda(hc, h_res, res, h_post, (agg, None))


def test_closed_group_refuses_new_states():
    """After `close()` a group takes no more sublayers."""
    hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=C, num_residual_streams=N))
    x = torch.randn(S, B, N * C)
    group = StreamRecompute(x)
    group.close()
    agg, h_res, h_post, res = hc(x)
    with pytest.raises(RuntimeError, match="closed"):
        group.post_residual_bda(hc, h_res, res, h_post, (agg, None))
