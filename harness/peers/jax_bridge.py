"""A JAX function as a differentiable PyTorch op: arrays converted at the boundary, gradients through `jax.vjp`.

The JAX peers (MaxText) run their own code on their own arrays. `jax_call(fn, dtype, *tensors)` converts the
torch tensors to JAX arrays of `dtype` (exactly: the checks' inputs are already rounded to it), runs `fn`
under `jax.vjp`, and returns torch tensors whose backward feeds the cotangents to the saved VJP, so the
conformance checks differentiate a JAX implementation as they do a torch one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["jax_call", "to_jax", "to_torch"]


def to_jax(t: torch.Tensor, dtype: Any) -> Any:
    """`t` as a JAX array of `dtype` (through fp64 NumPy: exact for values `dtype` holds)."""
    import jax.numpy as jnp

    return jnp.asarray(t.detach().double().cpu().numpy(), dtype=dtype)


def to_torch(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """The JAX array `a` as a torch tensor of `dtype`."""
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype)


class _JaxCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, dtype, *tensors):  # noqa: ANN001, ANN205 - autograd.Function's signature
        import jax

        arrays = [to_jax(t, dtype) for t in tensors]
        outs, vjp = jax.vjp(fn, *arrays)
        ctx.vjp, ctx.dtypes, ctx.out_dtypes = vjp, [t.dtype for t in tensors], [o.dtype for o in outs]
        return tuple(to_torch(o, tensors[0].dtype) for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        import jax.numpy as jnp

        cts = tuple(
            jnp.asarray(g.detach().double().numpy(), dtype=d)
            for g, d in zip(grads, ctx.out_dtypes, strict=True)
        )
        gin = ctx.vjp(cts)
        return (None, None, *(to_torch(g, d) for g, d in zip(gin, ctx.dtypes, strict=True)))


def jax_call(
    fn: Callable[..., tuple[Any, ...]], dtype: Any, *tensors: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`fn(*arrays) -> tuple of arrays` on `tensors` converted to JAX `dtype`; outputs in `tensors[0]`'s torch
    dtype, differentiable with respect to every tensor."""
    return _JaxCall.apply(fn, dtype, *tensors)
