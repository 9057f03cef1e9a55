"""Block boundary: expand one stream to `n`, contract `n` streams to one.

- `expand(x[s, b, C], n) -> [s, b, n*C]`: n copies, stream-major.
- `contract(x[s, b, n*C], n) -> [s, b, C]`: mean of the streams.
- `learned_contract(x[s, b, n*C], head_fn[n, n*C], head_base[n], head_scale[1], n, eps)
   -> [s, b, C]`: the `megatron_dev` exit, `pre = sigmoid(x @ head_fn^T * rsqrt(mean(x^2) + eps)
   * scale + base) + eps`, `y = sum_i pre_i x_i`, computed in fp32.
"""

from __future__ import annotations

import torch

from mhc_core.checks import check_dim, check_rank, check_streams, shape_str

__all__ = ["expand", "contract", "learned_contract"]


def _split_width(x: torch.Tensor, n: int, op: str) -> tuple[int, int]:
    """`(n, C)` of `x [s, b, n*C]`, `n` as a Python int."""
    n = check_streams(n, op=op)
    check_rank(x, 3, name="x", op=op, layout="[s, b, n*C]")
    if x.shape[-1] % n != 0 or x.shape[-1] == 0:
        raise ValueError(
            f"{op}: hidden width {x.shape[-1]} of x {shape_str(x)} is not a positive multiple of n={n}"
        )
    return n, x.shape[-1] // n


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """`[s, b, C] -> [s, b, n*C]`: every stream a copy of `x`."""
    op = "expand"
    n = check_streams(n, op=op)
    check_rank(x, 3, name="x", op=op, layout="[s, b, C]")
    s, b, c = x.shape
    return x.unsqueeze(-2).expand(s, b, n, c).reshape(s, b, n * c)


def contract(x: torch.Tensor, n: int) -> torch.Tensor:
    """`[s, b, n*C] -> [s, b, C]`: mean over the streams."""
    n, c = _split_width(x, n, "contract")
    s, b, _ = x.shape
    return x.view(s, b, n, c).mean(dim=-2)


def learned_contract(
    x: torch.Tensor,
    head_fn: torch.Tensor,
    head_base: torch.Tensor,
    head_scale: torch.Tensor,
    n: int,
    eps: float = 1e-5,
) -> torch.Tensor:
    """`[s, b, n*C] -> [s, b, C]` with learned, input-dependent stream weights (`megatron_dev`)."""
    op = "learned_contract"
    n, c = _split_width(x, n, op)
    s, b, _ = x.shape
    check_dim(head_fn, (n, n * c), name="head_fn", op=op, layout="[n, n*C]")
    check_dim(head_base, (n,), name="head_base", op=op, layout="[n]")
    check_dim(head_scale, (1,), name="head_scale", op=op, layout="[1]")
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # [s, b, 1]
    logits = (xf @ head_fn.to(acc).t()) * inv_rms * head_scale.to(acc) + head_base.to(acc)
    pre = torch.sigmoid(logits) + eps  # [s, b, n]
    y = torch.einsum("sbn,sbnc->sbc", pre, xf.view(s, b, n, c))
    return y.to(x.dtype)
