"""A stack of mHC sublayers on the reference module, in either form: the oracle of the models built on it.

`run_stack(h[s, b, C], connections, branches) -> [s, b, C]`

    x = expand(h, n)                                              # [s, b, n*C]
    per_sublayer:  agg, h_res, h_post, x_in = hc_k(x)             # each sublayer its own H_pre
    single_pass:   agg, h_res, h_post, h_pre = hc_k(x, h_pre)     # the previous sublayer's H_pre (None first)
    x = hc_k.post_residual_bda(h_res, x, h_post, (F_k(agg), None), dropout_p, training)
    exit: contract(x, n) (the mean; per_sublayer)  |  exit_aggregate(x, h_pre, n) (single_pass)

Run on fp64 modules and branches, it is the fp64 oracle a model of the same weights is compared with
(`suites/unit/core/test_single_pass.py`, `suites/unit/megatron/test_single_pass.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mhc_core.forms import ConnectionForm
from mhc_core.module import HyperConnectionModule
from mhc_core.ops.single_pass import exit_aggregate
from mhc_core.ops.streams import contract, expand

__all__ = ["run_stack"]


def run_stack(
    h: torch.Tensor,
    connections: Sequence[HyperConnectionModule],
    branches: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    *,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """`h [s, b, C]` through one sublayer per (connection, branch) and back to `[s, b, C]`.

    Raises:
        ValueError: no sublayer, as many branches as connections not given, or connections of different forms
            or stream counts (naming them).
    """
    op = "run_stack"
    if not connections or len(connections) != len(branches):
        raise ValueError(
            f"{op}: one branch per connection, at least one: got {len(connections)} connections and "
            f"{len(branches)} branches"
        )
    forms = {hc.hc_config.form for hc in connections}
    streams = {hc.n for hc in connections}
    if len(forms) != 1 or len(streams) != 1:
        raise ValueError(
            f"{op}: every connection of a stack has one form and one n; got forms "
            f"{sorted(f.value for f in forms)}, n {sorted(streams)}"
        )
    n, single = streams.pop(), forms.pop() == ConnectionForm.SINGLE_PASS
    x = expand(h, n)
    h_pre: torch.Tensor | None = None
    for hc, branch in zip(connections, branches, strict=True):
        if single:
            agg, h_res, h_post, h_pre = hc(x, previous_h_pre=h_pre)
        else:
            agg, h_res, h_post, _ = hc(x)
        x = hc.post_residual_bda(h_res, x, h_post, (branch(agg), None), dropout_p, training)
    if single:
        assert h_pre is not None  # at least one sublayer ran
        return exit_aggregate(x, h_pre, n)
    return contract(x, n)
