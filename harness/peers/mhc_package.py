"""The `mhc` package (PyPI `mhc` 0.5.5, gm24med/MHC) as a peer (pure PyTorch, CPU).

Despite its name it is not the paper's n-stream residual. Its layers keep a window of the last K
layer outputs (`HistoryBuffer`) and add a learned mix of them to the current one:
`MHCSkip` with K scalar weights per layer (a softmax over static logits, or one that keeps
`epsilon` on the newest state), `MatrixMHCSkip` with a `[K, K]` matrix made doubly stochastic by
Sinkhorn-Knopp, of which it keeps the last row. Nothing is computed per token: no projection of the
streams, no `H_pre` / `H_post`, no per-token `H_res`, no block exit. So the one op that maps is its
Sinkhorn-Knopp, `mhc.constraints.matrix.project_doubly_stochastic(logits, iterations)`, which
takes a batch of matrices: `exp(Z - rowmax)`, then per iteration rows then columns, each divided
by `sum + 1e-9` (upstream main's order and start; main divides by `clamp(sum, 1e-6)`). The other
ops are reported not comparable, each with its reason.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field

import torch

from harness.peers.base import Peer, TimedFn, Timing

__all__ = ["MhcPackagePeer", "VERSION"]

VERSION = "0.5.5"

_NO_STREAMS = (
    "the mhc package has no n-stream residual: its layers add a learned mix of the last K layer outputs (a "
    "window of past states, K scalar weights or a [K, K] doubly stochastic matrix per layer, the same for "
    "every token) to the current output"
)


@dataclass(frozen=True, kw_only=True)
class MhcPackagePeer(Peer):
    """The `mhc` package's Sinkhorn-Knopp (see the module docstring)."""

    name: str = "mhc"
    description: str = (
        "the mhc package (gm24med/MHC): mhc.constraints.matrix.project_doubly_stochastic, the Sinkhorn-Knopp "
        "of its MatrixMHCSkip (a history-window skip, not an n-stream residual)"
    )
    ops: frozenset[str] = frozenset({"sinkhorn"})
    streams: tuple[int, ...] = (2, 4)
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": _NO_STREAMS + "; no per-token coefficients (no projection, no H_pre / H_post)",
            "aggregate": _NO_STREAMS + "; nothing aggregates streams into a branch input",
            "mix": _NO_STREAMS + "; its mix is of past layer outputs with weights shared by every token",
            "layer": _NO_STREAMS,
            "block_exit": _NO_STREAMS + "; there is no block exit",
            "stack": _NO_STREAMS,
            "sinkhorn": "each normalisation divides by sum + 1e-9 (megatron_main: clamp(sum, 1e-6))",
        }
    )
    timing: Timing | None = Timing(variant="megatron_main", ops=frozenset({"sinkhorn"}))

    def version(self) -> str | None:
        try:
            return md.version("mhc")
        except md.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("mhc") is None or self.version() is None:
            return f"the mhc package is not installed (pip install mhc=={VERSION}; tox -e conformance has it)"
        return None

    def sinkhorn(self, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        from mhc.constraints.matrix import project_doubly_stochastic

        return project_doubly_stochastic(logits, iterations=iterations)

    def timed(self, op: str, *, n: int, hidden: int, dtype: torch.dtype, iterations: int) -> TimedFn:
        """`sinkhorn`: `project_doubly_stochastic` of the logits."""
        from mhc.constraints.matrix import project_doubly_stochastic

        return lambda d: (project_doubly_stochastic(d["logits"], iterations=iterations),)
