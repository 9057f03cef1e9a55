"""The forms of the connection: where each sublayer's aggregate weights come from.

A form is the data flow between sublayers, not their arithmetic: any numeric configuration
(`mhc_core.variants`) runs in either form.

- `per_sublayer` (mHC as the paper, upstream main and dev, DeepSeek-V4): sublayer `k` computes
  `H_pre_k, H_post_k, H_res_k` from its own input `x_k` and aggregates `x_k` with `H_pre_k`; the model's
  entry expands one stream to n copies, its exit contracts (mean or learned head).
- `single_pass` (DeepSeek-V4.1): the projection of sublayer `k` gives `H_post_k`, `H_res_k` and the `H_pre`
  of sublayer `k + 1`; sublayer `k` aggregates `x_k` with the `H_pre` its predecessor produced, the model's
  first sublayer with the identity mix (stream 0), and the exit aggregates with the last sublayer's `H_pre`
  (no learned head). The aggregate and the projection read the same `x_k` and neither waits for the other.
"""

from __future__ import annotations

import enum

__all__ = ["ConnectionForm"]


class ConnectionForm(enum.StrEnum):
    """The data flow of mHC between sublayers (a `StrEnum`: `str()` gives "single_pass")."""

    PER_SUBLAYER = "per_sublayer"
    """Each sublayer aggregates its input with the `H_pre` computed from that input."""
    SINGLE_PASS = "single_pass"
    """Each sublayer aggregates with the `H_pre` its predecessor computed (DeepSeek-V4.1)."""
