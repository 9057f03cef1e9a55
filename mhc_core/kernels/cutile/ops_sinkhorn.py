"""cuTile `sinkhorn`: `logits[..., n, n] -> [..., n, n]`, autograd function and wrapper.

Forward and backward are one launch each (`sinkhorn_fwd_kernel`, `sinkhorn_bwd_kernel`, or the
per-element `*_elem_kernel` pair with `SinkhornTiles.per_element`); only the
logits are saved, the backward kernel replays the iterations from them into an fp32 workspace
(`[P, B, n, n]`, per-element `[P, n*n, B]`; allocated per call) and walks them backwards. With
`SinkhornTiles.checkpoint` (per-element) and at most `tiling.MAX_CHECKPOINT_PAIRS` pairs the backward
is `sinkhorn_bwd_checkpoint_kernel`: the pair count `P` compiled in, a workspace of checkpoints only
(`[cdiv(P, checkpoint), n*n, B]`); with `fwd_checkpoints` the forward
(`sinkhorn_fwd_checkpoint_kernel`) fills that workspace, autograd keeps it, and the backward skips
its forward walk (that backward runs with the forward's tile and stride, whatever tile is in force
by then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.ops_common import VARIANT_CODE, cdiv, require_device, require_dtypes, require_n
from mhc_core.kernels.cutile.sinkhorn_common import num_pairs
from mhc_core.ops.sinkhorn import check_sinkhorn_args
from mhc_core.variants import Variant, get_variant

__all__ = ["sinkhorn"]


def _checkpoint_stride(tile: tiling.SinkhornTiles, pairs: int) -> int | None:
    """The checkpoint stride of the checkpointed backward for `pairs` pairs (None: not checkpointed):
    `tile.checkpoint` clamped to `pairs` (a stride past the last pair means one checkpoint)."""
    if not (tile.per_element and tile.checkpoint and pairs <= tiling.MAX_CHECKPOINT_PAIRS):
        return None
    return max(1, min(tile.checkpoint, pairs))


def _checkpoint_work(pairs: int, stride: int, n: int, batch: int, device: torch.device) -> torch.Tensor:
    """The checkpoints' workspace `[cdiv(P, stride), n*n, B]` fp32 (one row when P = 0)."""
    return torch.empty((max(cdiv(pairs, stride), 1), n * n, batch), dtype=torch.float32, device=device)


class _SinkhornFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int, eps: float, code: int, rt: Any):
        n = logits.shape[-1]
        z = logits.reshape(-1, n, n).contiguous()
        out = torch.empty_like(z)
        tile = tiling.sinkhorn_tile(n)
        pairs = num_pairs(iterations, code)
        stride = _checkpoint_stride(tile, pairs)
        saved = None  # the checkpoints, their stride and the tile, when the forward stores them for the backward
        if stride is not None and tile.fwd_checkpoints and pairs >= 1 and ctx.needs_input_grad[0]:
            work = _checkpoint_work(pairs, stride, n, z.shape[0], z.device)
            if z.shape[0]:
                rt.launch((cdiv(z.shape[0], tile.tile_b),), "sinkhorn_fwd_checkpoint_kernel",
                          (z, out, work, eps, n, tile.tile_b, code, int(tile.approx_div), pairs, stride))
            saved = (work, stride, tile)
        elif z.shape[0]:
            if tile.per_element:
                rt.launch((cdiv(z.shape[0], tile.tile_b),), "sinkhorn_fwd_elem_kernel",
                          (z, out, iterations, eps, n, tile.tile_b, code, int(tile.approx_div)))
            else:
                rt.launch((cdiv(z.shape[0], tile.tile_b),), "sinkhorn_fwd_kernel",
                          (z, out, iterations, eps, n, tile.tile_b, code, int(tile.batch_last)))
        ctx.save_for_backward(logits, *(saved[:1] if saved else ()))
        ctx.args = (iterations, eps, code, rt, saved[1:] if saved else None)
        return out.view(logits.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, *kept = ctx.saved_tensors
        iterations, eps, code, rt, kept_plan = ctx.args
        n = logits.shape[-1]
        z = logits.reshape(-1, n, n).contiguous()
        g = grad_out.to(logits.dtype).reshape(-1, n, n).contiguous()
        grad = torch.empty_like(z)
        pairs = num_pairs(iterations, code)
        if kept:  # the forward's checkpoints, with its stride and tile (whatever tile is in force now)
            stride, tile = kept_plan
        else:
            tile = tiling.sinkhorn_tile(n)
            stride = _checkpoint_stride(tile, pairs)
        if stride is not None:  # the checkpointed backward (reads `work` only when it was kept)
            work = kept[0] if kept else _checkpoint_work(pairs, stride, n, z.shape[0], z.device)
            if z.shape[0]:
                rt.launch((cdiv(z.shape[0], tile.tile_b),), "sinkhorn_bwd_checkpoint_kernel",
                          (z, g, grad, work, eps, n, tile.tile_b, code, int(tile.approx_div), pairs, stride,
                           int(bool(kept))))
            return grad.view(logits.shape), None, None, None, None
        # The kernel's scratch: the input of every normalisation pair, fp32, [max(P, 1), B, n, n]
        # or element-major [max(P, 1), n*n, B] for the per-element kernel (one dummy pair when the
        # kernel recomputes instead).
        pairs = 1 if tile.recompute else max(pairs, 1)
        layout = (n * n, z.shape[0]) if tile.per_element else z.shape
        work = torch.empty((pairs, *layout), dtype=torch.float32, device=z.device)
        if z.shape[0]:
            grid = (cdiv(z.shape[0], tile.tile_b),)
            if tile.per_element:
                rt.launch(grid, "sinkhorn_bwd_elem_kernel",
                          (z, g, grad, work, iterations, eps, n, tile.tile_b, code, int(tile.recompute),
                           int(tile.approx_div)))
            else:
                rt.launch(grid, "sinkhorn_bwd_kernel",
                          (z, g, grad, work, iterations, eps, n, tile.tile_b, code, int(tile.batch_last),
                           int(tile.recompute)))
        return grad.view(logits.shape), None, None, None, None


def sinkhorn(rt: Callable[[], Any], logits, iterations=20, eps=None, variant=Variant.MEGATRON_MAIN):
    """`mhc_core.ops.sinkhorn` on the runtime `rt()`: `logits[..., n, n] -> [..., n, n]`."""
    op = "sinkhorn"
    spec = get_variant(variant)
    iterations, eps = check_sinkhorn_args(logits, iterations, eps, spec, op=op)
    require_n(logits.shape[-1], op)
    require_dtypes(op, logits=logits)
    runtime = rt()
    require_device(runtime, op, logits=logits)
    return _SinkhornFn.apply(logits, iterations, eps, VARIANT_CODE[spec.variant], runtime)
