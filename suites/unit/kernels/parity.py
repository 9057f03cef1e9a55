"""Parity machinery shared by the kernel tests: one case type, one forward+backward runner.

A backend is compared with `reference` on identical inputs: every output with `tolerance(dtype,
"fwd")`, every input gradient with `tolerance(dtype, "bwd")` (dtype = the case's activation
dtype). In low precision the gradients that are sums over tokens (weight, alphas, bias) are
compared as vectors instead: cosine similarity >= 0.999 and the norm within the bwd tolerance, as
upstream's fused-kernel tests do (elementwise, a bf16 reference is off by whole ulps of the
largest terms wherever those sums cancel).

Compile budget: the compiled backend builds one graph per static configuration (op, variant, n,
dtypes, flags; see `mhc_core.kernels.compiled.common`). The cases below are chosen so that the
whole directory builds a few dozen small graphs; keep C = 64 and reuse the listed
(variant, n, dtype) combinations when adding tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mhc_core.kernels import dispatch
from mhc_core.testing import assert_close, assert_cosine, tolerance
from mhc_core.variants import Variant, VariantSpec, get_variant

__all__ = [
    "C",
    "DTYPE_NAMES",
    "FUSED_BACKENDS",
    "Case",
    "backend_params",
    "device_for",
    "run_fwd_bwd",
    "check_parity",
]

C = 64
"""Hidden size of every kernel test (one static C keeps the compiled graphs shared)."""

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}
FUSED_BACKENDS = ("compiled", "cutile")


def device_for(backend: str) -> str:
    """The device the parity tests of `backend` run on."""
    if backend == "cutile":
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_params() -> list:
    """`compiled` and `cutile` as pytest params, each skipped with its reason when unavailable."""
    params = []
    for backend in FUSED_BACKENDS:
        ok, why = dispatch.availability(backend, device_for(backend))
        params.append(pytest.param(backend, id=backend, marks=pytest.mark.skipif(not ok, reason=why)))
    return params


@dataclass(frozen=True, kw_only=True)
class Case:
    """One parity configuration; `str(case)` is the stable test id, e.g. `T48-n4-C64-fp32-megatron_main`."""

    tokens: int
    n: int
    dtype: torch.dtype
    variant: Variant | VariantSpec = Variant.MEGATRON_MAIN
    """A variant, or a configured one (`get_variant("megatron_dev+eps_inside_sqrt")`)."""
    hidden: int = C
    extra: str = ""

    def __str__(self) -> str:
        parts = [
            f"T{self.tokens}",
            f"n{self.n}",
            f"C{self.hidden}",
            DTYPE_NAMES[self.dtype],
            get_variant(self.variant).name,
        ]
        return "-".join(parts + ([self.extra] if self.extra else []))


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().clone().requires_grad_(requires_grad)


def run_fwd_bwd(
    fn: Callable,
    inputs: dict[str, torch.Tensor | None],
    grad_names: Sequence[str],
    seed: int = 1234,
    **kwargs,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Outputs of `fn(**inputs, **kwargs)` and the gradients of `grad_names` under fixed random cotangents."""
    leaves = {k: None if v is None else _leaf(v, k in grad_names) for k, v in inputs.items()}
    out = fn(**leaves, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss: Any = 0.0  # a tensor from the first output on
    for o in outs:
        cot = torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device)
        loss = loss + (o.float() * cot).sum()
    unknown = [k for k in grad_names if k not in inputs]
    if unknown:  # a misspelt name would otherwise never be compared
        raise ValueError(f"run_fwd_bwd: grad_names {unknown} are not inputs ({', '.join(inputs)})")
    names = [k for k in grad_names if leaves[k] is not None]  # an input passed as None has no gradient
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    return tuple(o.detach() for o in outs), {k: g for k, g in zip(names, grads, strict=True)}


def check_parity(
    name: str,
    reference: Callable,
    candidate: Callable,
    inputs: dict[str, torch.Tensor | None],
    grad_names: Sequence[str],
    dtype: torch.dtype,
    cosine_groups: Sequence[Sequence[str]] = (),
    **kwargs,
) -> None:
    """Assert `candidate` matches `reference`: outputs, every gradient, and cosine for `cosine_groups`."""
    __tracebackhide__ = True
    ref_out, ref_grads = run_fwd_bwd(reference, inputs, grad_names, **kwargs)
    got_out, got_grads = run_fwd_bwd(candidate, inputs, grad_names, **kwargs)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    fwd, bwd = tolerance(dtype, "fwd"), tolerance(dtype, "bwd")
    for i, (a, e) in enumerate(zip(got_out, ref_out, strict=True)):
        if a.dtype != e.dtype:
            raise AssertionError(f"{name}: output {i} dtype {a.dtype} != reference {e.dtype}")
        assert_close(f"{name}: output {i}", a, e, fwd)
    cosine_names = {k for group in cosine_groups for k in group} if low_precision else set()
    for k, e in ref_grads.items():
        a = got_grads[k]
        if (a is None) != (e is None):
            raise AssertionError(f"{name}: grad {k} is {'None' if a is None else 'set'} vs reference")
        if e is None:
            continue
        if a.dtype != e.dtype:
            raise AssertionError(f"{name}: grad {k} dtype {a.dtype} != reference {e.dtype}")
        if k not in cosine_names:
            assert_close(f"{name}: grad {k}", a, e, bwd)
    if low_precision:
        for group in cosine_groups:
            a = torch.cat([got_grads[k].float().flatten() for k in group])
            e = torch.cat([ref_grads[k].float().flatten() for k in group])
            assert_cosine(f"{name}: grads {'+'.join(group)}", a, e)
            norm_a, norm_e = float(a.norm()), float(e.norm())
            if abs(norm_a - norm_e) > bwd.rtol * norm_e + bwd.atol:
                raise AssertionError(
                    f"{name}: grads {'+'.join(group)}: norm {norm_a:.6g} vs reference {norm_e:.6g} "
                    f"(allowed {bwd.rtol:g} relative + {bwd.atol:g})"
                )
