"""cuTile `sinkhorn`: `logits[..., n, n] -> [..., n, n]`, autograd function and wrapper.

Forward and backward are one launch each of a `sinkhorn_kernels` kernel: `sinkhorn_fwd_kernel` /
`sinkhorn_bwd_kernel`, or with `SinkhornTiles.per_element` the `*_elem_kernel` pair. Only the logits are saved: the backward
kernel replays the iterations from them, into an fp32 workspace `[P, B, n, n]` (allocated per
call) that it walks backwards, or, per element, recomputing each pair's input instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.constants import num_pairs
from mhc_core.kernels.cutile.runtime import cdiv, require_device, require_dtypes, require_n, sinkhorn_code
from mhc_core.ops.sinkhorn import SinkhornCall

__all__ = ["sinkhorn"]


class _SinkhornFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int, eps: float, code: int, rt: Any):
        n = logits.shape[-1]
        z = logits.reshape(-1, n, n).contiguous()
        out = torch.empty_like(z)
        tile = tiling.sinkhorn_tile(n)
        if z.shape[0]:
            name = "sinkhorn_fwd_elem_kernel" if tile.per_element else "sinkhorn_fwd_kernel"
            rt.launch((cdiv(z.shape[0], tile.tile_b),), name, (z, out, iterations, eps, n, tile.tile_b, code))
        ctx.save_for_backward(logits)
        ctx.args = (iterations, eps, code, rt)
        return out.view(logits.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        iterations, eps, code, rt = ctx.args
        n = logits.shape[-1]
        z = logits.reshape(-1, n, n).contiguous()
        g = grad_out.to(logits.dtype).reshape(-1, n, n).contiguous()
        grad = torch.empty_like(z)
        tile = tiling.sinkhorn_tile(n)
        if z.shape[0]:
            grid = (cdiv(z.shape[0], tile.tile_b),)
            if tile.per_element:
                rt.launch(
                    grid, "sinkhorn_bwd_elem_kernel", (z, g, grad, iterations, eps, n, tile.tile_b, code)
                )
            else:
                # The kernel's scratch: the input of every normalisation pair, fp32 [max(P, 1), B, n, n].
                work = torch.empty(
                    (max(num_pairs(iterations, code), 1), *z.shape), dtype=torch.float32, device=z.device
                )
                rt.launch(
                    grid, "sinkhorn_bwd_kernel", (z, g, grad, work, iterations, eps, n, tile.tile_b, code)
                )
        return grad.view(logits.shape), None, None, None, None


def sinkhorn(rt: Callable[[], Any], call: SinkhornCall) -> torch.Tensor:
    """`mhc_core.ops.sinkhorn` of a checked call on the runtime `rt()`: `logits[..., n, n] -> [..., n, n]`."""
    op, logits = "sinkhorn", call.logits
    if call.spec.sinkhorn_in_input_dtype:
        raise NotImplementedError(
            f"{op}: no cuTile kernel iterates Sinkhorn in the logits' dtype (input_dtype_sinkhorn); the kernels "
            "iterate in fp32"
        )
    require_n(logits.shape[-1], op)
    require_dtypes(op, logits=logits)
    runtime = rt()
    require_device(runtime, op, logits=logits)
    return _SinkhornFn.apply(logits, call.iterations, call.eps, sinkhorn_code(call.spec), runtime)
