"""`h_post_bda` for the compiled backend: residual mix + gated branch + bias in one pass.

    forward   out_i = sum_j M[i, j] r_j + h_post_i (y + bias)          M = H (paper, megatron_main)
                                                                     or H^T (megatron_dev)
    backward  g_r_j    = sum_i M[i, j] g_i                              [T, n, C]
              g_M[i,j] = sum_c g_i r_j      (g_H = g_M, or g_M^T)        [T, n, n]
              g_hp_i   = sum_c g_i (y + bias)                           [T, n]
              g_y      = sum_i h_post_i g_i                             [T, C]
              g_bias   = sum_t g_y                                      [C]

Shapes: h_res `[T, n, n]`, residual `[T, n, C]`, h_post `[T, n]`, y `[T, C]`, bias `[C]` or None.
Products and sums in fp32 at least (the reference's accumulation dtype), unrolled over the static
`n` so that the forward is one pointwise kernel over `[T, n, C]`.

Dropout (`training and dropout_p > 0`), on the expanded branch as the reference and Megatron's
bias-dropout-add: fused too. The keep mask comes from a counter-based hash of the element index and an
int32 seed drawn from the device's default generator (`dropout.keep_mask`), so `torch.manual_seed`
and a restored RNG state replay it, as mHC recompute needs. Only the seed is saved: the backward
recomputes the mask in its own kernel, so no `[T, n, C]` mask is written or read:

    out_i   = mix_i + keep_i * h_post_i (y + bias) / (1 - p)
    g_hp_i  = sum_c g_i keep_i (y + bias) / (1 - p),   g_y = sum_i h_post_i keep_i g_i / (1 - p)

The draw is not eager's: the same seed gives another mask than `mhc_core.ops.h_post_bda`, so
parity is checked against the reference formulation with the mask `dropout.keep_mask` rebuilds from
the saved seed.
"""

from __future__ import annotations

import torch

from mhc_core.kernels.compiled.common import acc_dtype, compile_for, mark_dynamic
from mhc_core.kernels.compiled.dropout import draw_seed, keep_mask
from mhc_core.ops.post_bda import PostBdaCall, h_post_bda_reference

__all__ = ["h_post_bda"]


def _acc(h_res: torch.Tensor, res: torch.Tensor) -> torch.dtype:
    return acc_dtype(res.dtype, h_res.dtype)


def _fwd(h_res, res, h_post, y, bias, seed, transposed: bool, p: float):
    """`out [T, n, C]`; with `p > 0` the branch is dropped where `keep_mask(seed, ...)` is False."""
    acc = _acc(h_res, res)
    m = h_res.to(acc)
    if transposed:
        m = m.transpose(1, 2)
    branch_in = y.to(acc) if bias is None else y.to(acc) + bias.to(acc)
    out = h_post.to(acc)[:, :, None] * branch_in[:, None, :]  # [T, n, C]
    if p > 0:
        out = torch.where(keep_mask(seed, out.shape, p), out * (1.0 / (1.0 - p)), 0.0)
    for j in range(res.shape[1]):
        out = out + m[:, :, j, None] * res[:, None, j, :].to(acc)
    return out.to(res.dtype)


_TOKEN_BLOCK = 16


def _sum_tokens(t: torch.Tensor) -> torch.Tensor:
    """`[T, C] -> [C]`, the sum over tokens in two levels (blocks of 16 tokens, then the blocks, then the
    remainder): Inductor's C++ backend vectorises a reduction over the inner dim of a block far better than
    one over all T rows."""
    tokens = t.shape[0]
    blocks = tokens // _TOKEN_BLOCK
    whole = blocks * _TOKEN_BLOCK
    out = t[:whole].reshape(blocks, _TOKEN_BLOCK, t.shape[1]).sum(1).sum(0)
    return out + t[whole:].sum(0)


def _bwd(g, h_res, res, h_post, y, bias, seed, transposed: bool, needs: tuple[bool, ...], p: float):
    acc = _acc(h_res, res)
    need_hres, need_res, need_hpost, need_y, need_bias = needs
    n = res.shape[1]
    gf = g.to(acc)
    # The branch's gradient: the forward's mask, rebuilt from its seed.
    gb = gf if p == 0 else torch.where(keep_mask(seed, gf.shape, p), gf * (1.0 / (1.0 - p)), 0.0)
    m = h_res.to(acc)
    if transposed:
        m = m.transpose(1, 2)
    g_res = g_hres = g_hpost = g_y = g_bias = None
    # g_M is built one row i at a time, as n reductions of the [T, n(j)] x C group: Inductor's C++ backend
    # fuses the n of them into one loop nest (one load of each residual stream per n products), where
    # one [T, n, n] x C reduction reloads both operands for every product.
    if need_res:
        out = m[:, 0, :, None] * gf[:, 0, None, :]
        for i in range(1, n):
            out = out + m[:, i, :, None] * gf[:, i, None, :]
        g_res = out.to(res.dtype)
    if need_hres:
        resf = res.to(acc)
        g_m = torch.stack([(gf[:, i, None, :] * resf).sum(-1) for i in range(n)], dim=1)  # [T, n(i), n(j)]
        g_hres = (g_m.transpose(1, 2) if transposed else g_m).to(h_res.dtype)
    if need_hpost:
        branch_in = y.to(acc) if bias is None else y.to(acc) + bias.to(acc)
        g_hpost = (gb * branch_in[:, None, :]).sum(-1).to(h_post.dtype)
    if need_y or need_bias:
        hp = h_post.to(acc)
        g_branch = hp[:, 0:1] * gb[:, 0]
        for i in range(1, n):
            g_branch = g_branch + hp[:, i : i + 1] * gb[:, i]  # [T, C]
        if need_y:
            g_y = g_branch.to(y.dtype)
        if need_bias:
            g_bias = _sum_tokens(g_branch).to(bias.dtype)
    return g_hres, g_res, g_hpost, g_y, g_bias


class _HPostBDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, res, h_post, y, bias, transposed: bool, p: float):
        ctx.transposed, ctx.p = transposed, p
        dtypes = tuple(None if t is None else t.dtype for t in (h_res, res, h_post, y, bias))
        key = (*dtypes, res.shape[1], transposed, p, res.device.type)
        h_res_d, res_d, h_post_d, y_d = (mark_dynamic(t, 0) for t in (h_res, res, h_post, y))
        seed = draw_seed(res.device) if p > 0 else None
        out = compile_for(_fwd, key)(h_res_d, res_d, h_post_d, y_d, bias, seed, transposed, p)
        ctx.save_for_backward(h_res, res, h_post, y, bias, seed)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        h_res, res, h_post, y, bias, seed = ctx.saved_tensors
        needs = tuple(bool(v) for v in ctx.needs_input_grad[:5])
        needs = needs[:4] + (needs[4] and bias is not None,)
        dtypes = tuple(None if t is None else t.dtype for t in (g, h_res, res, h_post, y, bias))
        key = (*dtypes, res.shape[1], ctx.transposed, needs, ctx.p, res.device.type)
        g, h_res, res, h_post, y = (mark_dynamic(t, 0) for t in (g.contiguous(), h_res, res, h_post, y))
        grads = compile_for(_bwd, key)(g, h_res, res, h_post, y, bias, seed, ctx.transposed, needs, ctx.p)
        return (*grads, None, None)


def h_post_bda(call: PostBdaCall) -> torch.Tensor:
    """New `n`-stream residual (compiled backend) of a checked call (`mhc_core.ops.h_post_bda`); hidden dropout
    on the expanded branch when training is fused, with its own mask.

    Returns:
        `[T, n, C]` in `residual.dtype`.
    """
    if call.residual.numel() == 0:
        return h_post_bda_reference(call)
    bias = call.bias
    return _HPostBDA.apply(
        call.h_res.contiguous(),
        call.residual.contiguous(),
        call.h_post.contiguous(),
        call.y.contiguous(),
        None if bias is None else bias.contiguous(),
        call.spec.res_transposed,
        call.dropout_p if call.training else 0.0,
    )
