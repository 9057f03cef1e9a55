"""Shared inputs and the fwd + bwd comparison for the cuTile parity tests (emulated and GPU).

Every op is run forward, then backward with one random output gradient shared by kernel and
reference; outputs use the `fwd` tolerance of the activation dtype, input gradients the `bwd`
one, and for bf16 the small coefficient gradients (alphas, bias) are also checked by cosine
similarity.

Oracle for `mapping` in `megatron_main` with bf16 activations: the reference evaluated in fp64
from the same inputs, outputs rounded to bf16. The kernels accumulate in fp32 by design, while
that reference rounds every intermediate to bf16; its own error on `grad_weight` exceeds the
bf16 tolerance (measured: 3x the kernel's error against fp64). The plain bf16 reference is still
compared by cosine similarity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mhc_core import ops as ref
from mhc_core.testing import assert_close, assert_cosine, tolerance
from mhc_core.variants import Variant, get_variant

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
VARIANT_NAMES = {v: v.tag for v in Variant}


def _run(fn: Callable, inputs: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor] | None):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    if grads is None:
        gen = torch.Generator(device="cpu").manual_seed(1234)
        grads = [torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in outs]
    torch.autograd.backward(outs, list(grads))
    return outs, [None if t is None else t.grad for t in leaves], grads


def grad_errors_vs_fp64(
    kernel: Callable, oracle: Callable, inputs: Sequence[torch.Tensor], grad: torch.Tensor, wrt: Sequence[int]
) -> list[float]:
    """For each input index in `wrt`: the max error of `kernel`'s gradient (output gradient `grad`)
    against `oracle`'s run in fp64, relative to the largest entry of the fp64 gradient."""
    leaves = [a.detach().clone().requires_grad_(True) for a in inputs]
    exact = [a.detach().double().requires_grad_(True) for a in inputs]
    got = torch.autograd.grad(kernel(*leaves), [leaves[i] for i in wrt], grad)
    want = torch.autograd.grad(oracle(*exact), [exact[i] for i in wrt], grad.double())
    return [float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True)]


def compare(
    name: str,
    kernel_fn: Callable,
    reference_fn: Callable,
    inputs: Sequence[torch.Tensor | None],
    dtype: torch.dtype,
    *,
    input_names: Sequence[str],
    cosine_inputs: Sequence[str] = (),
    oracle_fn: Callable | None = None,
    out_kind: str = "fwd",
    row_scaled: Sequence[str] = (),
) -> None:
    """Forward outputs (tolerance kind `out_kind`) and every input gradient of `kernel_fn` against `reference_fn`.

    The gradients of the inputs in `row_scaled` are compared in units of each row's largest expected entry
    (at least 1): the pre-op's weight gradient carries the aggregate's sum over C in its h_pre rows, ~25x the
    other rows at C 1024 (~440 against ~18), where a bound sized for O(1) entries tests the summation order
    (the fp32 reference itself misses it against fp64), not the kernel."""
    k_out, k_grad, grads = _run(kernel_fn, inputs, None)
    r_out, r_grad, _ = _run(reference_fn, inputs, grads)
    if oracle_fn is not None:
        o_out, o_grad, _ = _run(oracle_fn, inputs, grads)
        for i, (a, b) in enumerate(zip(k_grad, r_grad, strict=True)):
            if a is not None and b is not None:
                assert_cosine(f"{name}: grad {input_names[i]} (vs bf16 reference)", a, b)
        r_out = [o.to(k.dtype) for o, k in zip(o_out, k_out, strict=True)]
        r_grad = [None if g is None else g.to(k.dtype) for g, k in zip(o_grad, k_grad, strict=True)]
    for i, (a, b) in enumerate(zip(k_out, r_out, strict=True)):
        assert_close(f"{name}: output {i}", a, b, tolerance(dtype, out_kind))
    for i, (a, b) in enumerate(zip(k_grad, r_grad, strict=True)):
        if a is None and b is None:
            continue
        assert a is not None and b is not None, f"{name}: grad {input_names[i]} missing on one side"
        if input_names[i] in row_scaled:
            scale = b.detach().double().abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
            assert_close(
                f"{name}: grad {input_names[i]} (in units of each row's largest entry)",
                a.double() / scale,
                b.double() / scale,
                tolerance(dtype, "bwd"),
            )
        else:
            assert_close(f"{name}: grad {input_names[i]}", a, b, tolerance(dtype, "bwd"))
        if dtype != torch.float32 and input_names[i] in cosine_inputs:
            assert_cosine(f"{name}: grad {input_names[i]}", a, b)


def sinkhorn_inputs(n: int, dtype: torch.dtype, device, batch: int = 37):
    gen = torch.Generator(device="cpu").manual_seed(10 + n)
    return [(torch.randn(batch, n, n, generator=gen) * 2).to(device=device, dtype=dtype)]


def aggregate_inputs(t: int, n: int, c: int, x_dtype, h_dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(20 + n)
    x = torch.randn(t, n, c, generator=gen).to(device=device, dtype=x_dtype)
    h = torch.rand(t, n, generator=gen).to(device=device, dtype=h_dtype)
    return [x, h]


def post_bda_inputs(t: int, n: int, c: int, x_dtype, h_dtype, with_bias: bool, device):
    gen = torch.Generator(device="cpu").manual_seed(30 + n)
    h_res = torch.rand(t, n, n, generator=gen).to(device=device, dtype=h_dtype)
    residual = torch.randn(t, n, c, generator=gen).to(device=device, dtype=x_dtype)
    h_post = (2 * torch.rand(t, n, generator=gen)).to(device=device, dtype=h_dtype)
    y = torch.randn(t, c, generator=gen).to(device=device, dtype=x_dtype)
    bias = torch.randn(c, generator=gen).to(device=device, dtype=x_dtype) if with_bias else None
    return [h_res, residual, h_post, y, bias]


def mapping_inputs(t: int, n: int, c: int, x_dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(40 + n)
    big_n = ref.num_mapping_outputs(n)
    x = torch.randn(t, n * c, generator=gen).to(device=device, dtype=x_dtype)
    weight = (torch.randn(big_n, n * c, generator=gen) * 0.05).to(device)
    alphas = [torch.tensor([a], device=device) for a in (0.7, -0.4, 1.3)]
    bias = (torch.randn(big_n, generator=gen) * 0.5).to(device)
    return [x, weight, *alphas, bias]


def mapping_oracle(n: int, variant):
    """The reference in fp64 from the same inputs (see the module docstring).

    The weight is first rounded to the activation dtype, as the `megatron_main` reference (and
    the kernel's bf16 MMA) rounds it: without that the oracle differs from both by the weight's
    own rounding, up to 4 bf16 ulps of a logit at K = 8192 (measured on an H200).
    """

    def fn(x, weight, alpha_pre, alpha_post, alpha_res, bias):
        w = weight if get_variant(variant).mapping_fp32 else weight.to(x.dtype)
        return ref.mapping(
            x.double(),
            w.double(),
            alpha_pre.double(),
            alpha_post.double(),
            alpha_res.double(),
            bias.double(),
            n=n,
            variant=variant,
        )

    return fn


def pre_oracle(n: int, variant, iterations: int):
    """`mapping_oracle` for the fused pre-op: `ref.pre` in fp64, the weight rounded as the mapping's is."""

    def fn(x, weight, alpha_pre, alpha_post, alpha_res, bias):
        w = weight if get_variant(variant).mapping_fp32 else weight.to(x.dtype)
        return ref.pre(
            x.double(),
            w.double(),
            alpha_pre.double(),
            alpha_post.double(),
            alpha_res.double(),
            bias.double(),
            n=n,
            iterations=iterations,
            variant=variant,
        )

    return fn


MAPPING_INPUT_NAMES = ("x", "weight", "alpha_pre", "alpha_post", "alpha_res", "bias")
MAPPING_COSINE = ("alpha_pre", "alpha_post", "alpha_res", "bias")
POST_BDA_INPUT_NAMES = ("h_res", "residual", "h_post", "y", "bias")
