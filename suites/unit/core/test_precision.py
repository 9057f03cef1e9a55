"""`mhc_core.precision`: marked parameters stay fp32 through half-precision casts (`paper`, `megatron_dev`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mhc_core import HyperConnectionConfig, HyperConnectionModule
from mhc_core.precision import KEEP_IN_FP32_ATTR, KeepInFp32Mixin, is_kept_in_fp32, mark_keep_in_fp32

N, C = 4, 8


def _module(variant: str, seed: int = 0) -> HyperConnectionModule:
    torch.manual_seed(seed)
    m = HyperConnectionModule(HyperConnectionConfig(hidden_size=C, num_residual_streams=N, variant=variant))
    with torch.no_grad():  # non-trivial values, so a rounding through bf16 would show
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def test_mark_uses_upstream_attribute_name():
    """The mark is `tensor.keep_in_fp32 = True`, the attribute newer megatron-core's Float16Module reads."""
    p = nn.Parameter(torch.zeros(2))
    assert not is_kept_in_fp32(p)
    assert mark_keep_in_fp32(p) is p
    assert (
        KEEP_IN_FP32_ATTR == "keep_in_fp32" and getattr(p, KEEP_IN_FP32_ATTR) is True and is_kept_in_fp32(p)
    )


@pytest.mark.parametrize("cast", ["bfloat16", "half", "to_bf16"])
@pytest.mark.parametrize("variant", ["megatron_dev", "paper"])
def test_kept_variants_stay_fp32_bitwise(variant, cast):
    """paper / megatron_dev: after `.bfloat16()`, `.half()` or `.to(bf16)` every parameter is fp32 with its exact old value."""
    m = _module(variant)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    {"bfloat16": m.bfloat16, "half": m.half, "to_bf16": lambda: m.to(torch.bfloat16)}[cast]()
    for name, p in m.named_parameters():
        assert p.dtype == torch.float32, (name, p.dtype)
        assert torch.equal(p, before[name]), name
        assert is_kept_in_fp32(p), name


def test_main_is_cast_with_the_model():
    """megatron_main: parameters follow the model to bf16 (upstream main has no keep-in-fp32)."""
    m = _module("megatron_main").bfloat16()
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert not any(is_kept_in_fp32(p) for p in m.parameters())


def test_double_is_allowed_and_a_later_half_cast_returns_to_fp32():
    """A cast to fp64 (gradient checks) is honoured; a later bf16 cast lands on fp32, not bf16."""
    m = _module("megatron_dev").double()
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    m.bfloat16()
    assert {p.dtype for p in m.parameters()} == {torch.float32}


def test_gradients_are_restored_with_their_parameters():
    """A parameter's existing gradient comes back fp32 (and unrounded) after a bf16 cast."""
    m = _module("megatron_dev")
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.bfloat16()
    for name, p in m.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, grads[name]), name


def test_bf16_activations_use_the_unrounded_fp32_weights():
    """megatron_dev on bf16 activations: a cast module gives bitwise the outputs of its never-cast twin."""
    cast, twin = _module("megatron_dev", seed=3).bfloat16(), _module("megatron_dev", seed=3)
    x = torch.randn(5, 2, N * C).to(torch.bfloat16)
    for a, b in zip(cast(x), twin(x), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _Outer(KeepInFp32Mixin, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.own = mark_keep_in_fp32(nn.Parameter(torch.randn(3)))
        self.plain = nn.Parameter(torch.randn(3))
        self.inner = _module("megatron_dev")  # a nested mixin restores its own parameters


def test_nested_mixins_each_restore_their_own():
    """An outer mixin keeps its marked parameter, leaves unmarked ones to the cast, and the nested one keeps its own."""
    m = _Outer().bfloat16()
    assert m.own.dtype == torch.float32 and m.plain.dtype == torch.bfloat16
    assert {p.dtype for p in m.inner.parameters()} == {torch.float32}
    assert [name for _, name in m._marked_parameters()] == ["own"]
