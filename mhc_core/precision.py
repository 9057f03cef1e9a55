"""Parameters that stay fp32 when the model is cast to fp16 / bf16 (`megatron_dev`, `paper`).

megatron-core's `Float16Module` casts the whole model with `module.bfloat16()` (or `.half()`).
Upstream's dev generation keeps the mHC parameters fp32 through that cast; newer megatron-core
releases do it with `mark_keep_in_fp32(tensor)`, which sets `tensor.keep_in_fp32 = True`, and a
`Float16Module` that skips marked tensors. The releases this suite supports (0.16.1, 0.19.2) have
neither, so the same contract is kept from the module side:

- `mark_keep_in_fp32(p)` sets the same attribute (so a newer `Float16Module` honours it as is);
- `KeepInFp32Mixin` (listed before `nn.Module` in the bases) restores its marked parameters, and
  their gradients, to fp32 (from the values before the cast) after any `_apply` that turned them
  into fp16 / bf16. `.bfloat16()`,
  `.half()`, `.to(dtype)` and `.cuda()` all go through `_apply`. A cast to fp64 is left alone
  (gradient checks run the module in double precision).

A mixin owns the marked parameters of its subtree, except those under a nested mixin, which
restores its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["KEEP_IN_FP32_ATTR", "KeepInFp32Mixin", "is_kept_in_fp32", "mark_keep_in_fp32"]

KEEP_IN_FP32_ATTR = "keep_in_fp32"
"""The tensor attribute upstream megatron-core's `mark_keep_in_fp32` sets."""

_HALF = (torch.float16, torch.bfloat16)


def mark_keep_in_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Mark `tensor` (a parameter) to stay fp32 through half-precision casts; returns it."""
    setattr(tensor, KEEP_IN_FP32_ATTR, True)
    return tensor


def is_kept_in_fp32(tensor: torch.Tensor) -> bool:
    """Whether `tensor` carries the keep-in-fp32 mark."""
    return bool(getattr(tensor, KEEP_IN_FP32_ATTR, False))


class KeepInFp32Mixin:
    """Restore marked fp32 parameters after a cast to fp16 / bf16 (see the module docstring)."""

    def _marked_parameters(self) -> Iterator[tuple[nn.Module, str]]:
        """(owner module, parameter name) of each marked parameter this mixin restores."""

        def walk(module: nn.Module, root: bool) -> Iterator[tuple[nn.Module, str]]:
            if not root and isinstance(module, KeepInFp32Mixin):
                return
            for name, p in module._parameters.items():
                if p is not None and is_kept_in_fp32(p):
                    yield module, name
            for child in module._modules.values():
                if child is not None:
                    yield from walk(child, False)

        assert isinstance(self, nn.Module)
        return walk(self, True)

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001 - nn.Module._apply's own signature
        pinned = []
        for owner, name in self._marked_parameters():
            p = owner._parameters[name]
            assert p is not None  # _marked_parameters yields set parameters only
            if p.is_floating_point() and p.dtype not in _HALF:
                pinned.append((owner, name, p.data, None if p.grad is None else p.grad.data))
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        for owner, name, data, grad in pinned:
            p = owner._parameters[name]  # a new object when torch overwrites parameters on conversion
            if p is not None and p.dtype in _HALF:
                p.data = data.to(device=p.device, dtype=torch.float32)
                if grad is not None and p.grad is not None:
                    p.grad = grad.to(device=p.device, dtype=torch.float32)
                mark_keep_in_fp32(p)
        return out
