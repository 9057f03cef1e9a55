"""mHC-lite's residual matrix (`ResidualConstraint.PERMUTATIONS`): the permutation mixture and the module with it."""

from __future__ import annotations

import itertools

import pytest
import torch

from mhc_core.config import HyperConnectionConfig
from mhc_core.module import HyperConnectionModule
from mhc_core.ops.mapping import gated_projection
from mhc_core.ops.permutations import num_permutations, permutation_matrices, permutation_mixture


def test_matrices_are_the_permutations_in_itertools_order():
    """n = 3: six distinct permutation matrices, the identity first, row i's one in column perm[i]."""
    mats = permutation_matrices(3, torch.float64)
    assert mats.shape == (6, 3, 3) and torch.equal(mats[0], torch.eye(3, dtype=torch.float64))
    for m, perm in zip(mats, itertools.permutations(range(3)), strict=True):
        assert [int(m[i].argmax()) for i in range(3)] == list(perm)
    assert len({tuple(m.flatten().tolist()) for m in mats}) == 6


def test_mixture_of_two_streams_by_hand():
    """n = 2: `H = w0 I + w1 [[0, 1], [1, 0]]` with `w = softmax(logits)`."""
    logits = torch.tensor([[0.3, -1.1]], dtype=torch.float64)
    w = torch.softmax(logits, -1)[0]
    expected = torch.tensor([[w[0], w[1]], [w[1], w[0]]], dtype=torch.float64)
    assert torch.allclose(permutation_mixture(logits, 2)[0], expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"]
)
def test_mixture_is_doubly_stochastic_without_iterations(dtype):
    """Rows and columns sum to 1 to the rounding of the dtype, at any logit scale."""
    logits = (torch.randn(7, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 10).to(
        dtype
    )
    h = permutation_mixture(logits, 4).double()
    bound = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert (h.sum(-1) - 1).abs().max() <= bound and (h.sum(-2) - 1).abs().max() <= bound


def test_bad_shapes_and_too_many_streams_are_named():
    """Logits of the wrong width, and n beyond 6, are errors naming the numbers."""
    with pytest.raises(ValueError, match=r"\[T, 24\] for n=4"):
        permutation_mixture(torch.zeros(3, 16), 4)
    with pytest.raises(ValueError, match="5040 permutations"):
        num_permutations(7)
    with pytest.raises(ValueError, match="num_residual_streams <= 6"):
        HyperConnectionConfig(hidden_size=8, num_residual_streams=7, h_res_constraint="permutations")


def test_module_with_the_permutation_mixture():
    """The module's projection has 2n + n! outputs; its H_res is the mixture of the mapping's n! logits, and every
    parameter receives a gradient."""
    cfg = HyperConnectionConfig(
        hidden_size=8,
        num_residual_streams=4,
        h_res_constraint="permutations",
        variant="megatron_dev",
        init_gating_factor=0.5,
    )
    m = HyperConnectionModule(cfg).double()
    assert m.mapping_proj.weight.shape == (32, 32) and m.bias.shape == (32,)
    with torch.no_grad():
        m.bias.copy_(torch.randn(32, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    x = torch.randn(5, 1, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    agg, h_res, h_post, _ = m(x)
    _, _, logits = gated_projection(
        x.reshape(5, 32),
        m.mapping_proj.weight,
        m.alpha_pre,
        m.alpha_post,
        m.alpha_res,
        m.bias,
        4,
        cfg.numerics,
        cfg.norm_eps,
        "permutations",
        op="test",
    )
    assert logits.shape == (5, 24)
    assert torch.allclose(h_res.reshape(5, 4, 4), permutation_mixture(logits, 4), rtol=0, atol=1e-15)
    (
        agg.sum() + (h_res * torch.arange(16.0, dtype=torch.float64).reshape(4, 4)).sum() + h_post.sum()
    ).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
