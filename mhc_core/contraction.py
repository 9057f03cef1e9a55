"""`LearnedContraction`: the `megatron_dev` block exit as a module (params `hc_head_fn/base/scale`)."""

from __future__ import annotations

import torch
from torch import nn

from mhc_core.config import PARAM_DTYPE
from mhc_core.ops.streams import learned_contract

__all__ = ["LearnedContraction"]


class LearnedContraction(nn.Module):
    """`[s, b, n*C] -> [s, b, C]` with `hc_head_fn [n, n*C]` (xavier), `hc_head_base [n]` (0),
    `hc_head_scale [1]` (1), all fp32; eps is the model's layernorm epsilon."""

    def __init__(self, hidden_size: int, num_residual_streams: int, eps: float = 1e-5):
        super().__init__()
        n, c = num_residual_streams, hidden_size
        self.n, self.eps = n, eps
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * c, dtype=PARAM_DTYPE))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=PARAM_DTYPE))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=PARAM_DTYPE))
        nn.init.xavier_uniform_(self.hc_head_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [s, b, n*C] -> [s, b, C]`."""
        return learned_contract(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.n, self.eps)
