"""Dropout masks from a counter-based hash: drawn inside a fused kernel, recomputed in the backward.

    keep[e] = (lowbias32(int32(e) * GOLDEN + seed) & 0xFFFFFF) >= round(p * 2^24)

`e` is the element's flat index in the `[T, n, C]` branch, `seed` an int32 drawn from the device's
default generator (`draw_seed`), so `torch.manual_seed` and a restored RNG state replay the mask, as
mHC recompute needs. `lowbias32` is Wellons' 32-bit integer finaliser (two multiplies, three
xor-shifts): plain int32 tensor ops that Inductor vectorises on CPU and lowers to Triton on GPU, so
the mask costs a few integer instructions per element, where Inductor's `rand_like` on CPU costs more
than the whole op. The backward rebuilds the mask from the saved seed: no `[T, n, C]` mask is written
or read. Indices past 2^32 wrap (a mask repeats after 4.3e9 elements of one call).

Shifts are arithmetic on int32 tensors, so each one is masked to act as a logical shift.
"""

from __future__ import annotations

import torch

__all__ = ["keep_mask", "draw_seed", "KEEP_BITS"]

KEEP_BITS = 24
"""Bits of the hash compared with the threshold: p is resolved to 2^-24."""
_GOLDEN = -1640531527  # 0x9E3779B9 as int32
_M1 = 0x7FEB352D
_M2 = -2073254261  # 0x846CA68B as int32


def _lowbias32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def keep_mask(seed: torch.Tensor, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """`bool [*shape]` on `seed`'s device: True where the element is kept (probability `1 - p`).

    Args:
        seed: `[]` int32, from `draw_seed`.
        shape: the branch's shape, `[T, n, C]`.
        p: dropout probability in `[0, 1)`.
    """
    if seed.dtype != torch.int32 or seed.dim() != 0:
        raise ValueError(
            f"keep_mask: seed must be a 0-d int32 tensor, got {seed.dtype} of shape {tuple(seed.shape)}"
        )
    if not 0.0 <= p < 1.0:
        raise ValueError(f"keep_mask: p={p} is outside [0, 1)")
    numel = 1
    for s in shape:
        numel *= s
    idx = torch.arange(numel, dtype=torch.int64, device=seed.device).to(torch.int32).view(shape)
    h = _lowbias32(idx * _GOLDEN + seed)
    return (h & ((1 << KEEP_BITS) - 1)) >= round(p * (1 << KEEP_BITS))


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """`[]` int32 seed from the default generator of `device` (advances it, as a dropout draw does)."""
    return torch.randint(-(2**31), 2**31 - 1, (), dtype=torch.int32, device=device)
