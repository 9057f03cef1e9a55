"""mHC-lite's residual matrix: a convex combination of the n! permutation matrices (`ResidualConstraint.PERMUTATIONS`).

    P_p[i, j] = 1 where j = perm_p(i)     perm_p: the p-th permutation of range(n) in `itertools.permutations`
                                          order (the identity first), as MaxText orders them
    H_res     = sum_p softmax(logits)_p P_p    logits [T, n!], the softmax in fp32 (fp64 for fp64 logits)

Every such matrix is exactly doubly stochastic (up to the rounding of the softmax's sum), so no iterations are
needed; the price is `n!` logits per token (24 at n = 4), which is why it is offered for n <= `MAX_STREAMS`.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import torch

from mhc_core.checks import check_rank, shape_str

__all__ = ["MAX_STREAMS", "num_permutations", "permutation_matrices", "permutation_mixture"]

MAX_STREAMS = 6
"""The largest n with a permutation mixture (720 logits per token)."""


def num_permutations(n: int) -> int:
    """n!, after checking `n` (ValueError naming it above `MAX_STREAMS`)."""
    if not 1 <= n <= MAX_STREAMS:
        raise ValueError(
            f"permutation mixture: n={n} streams has {math.factorial(max(n, 0))} permutations; "
            f"supported 1 <= n <= {MAX_STREAMS}"
        )
    return math.factorial(n)


@cache
def _matrices(n: int) -> torch.Tensor:
    eye = torch.eye(n, dtype=torch.float64)
    return torch.stack([eye[list(perm)] for perm in itertools.permutations(range(n))])


def permutation_matrices(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """`[n!, n, n]`: row `i` of the p-th matrix has its one in column `perm_p[i]`."""
    num_permutations(n)
    return _matrices(n).to(dtype=dtype, device=device)


def permutation_mixture(logits: torch.Tensor, n: int) -> torch.Tensor:
    """`H_res [T, n, n]` from `logits [T, n!]` (in the logits' dtype; computed in fp32, or fp64 for fp64)."""
    op = "permutation_mixture"
    check_rank(logits, 2, name="logits", op=op, layout="[T, n!]")
    if logits.shape[1] != num_permutations(n):
        raise ValueError(
            f"{op}: logits must be [T, n!] = [T, {math.factorial(n)}] for n={n}, got {shape_str(logits)}"
        )
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    weights = torch.softmax(logits.to(compute), dim=-1)  # [T, n!]
    mats = permutation_matrices(n, compute, logits.device)  # [n!, n, n]
    return torch.einsum("tp,pij->tij", weights, mats).to(logits.dtype)
