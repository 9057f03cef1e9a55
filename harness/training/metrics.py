"""Per-step metrics of a functional run: names, memory readings, the progress line, and the
metrics file (Megatron's golden schema) the last rank writes and the runner reads back.

Metric names follow Megatron-LM's TensorBoard / golden names: `lm loss`, `num-zeros`,
`iteration-time` (seconds), `mem-allocated-bytes` / `mem-max-allocated-bytes` (GPU); plus
`grad-norm` and, on CPU, `mem-max-rss-bytes` (peak resident set of the writing rank,
`resource.getrusage`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "GRAD_NORM",
    "ITERATION_TIME",
    "LM_LOSS",
    "NUM_ZEROS",
    "StepRecord",
    "memory_metrics",
    "progress_line",
    "read_metrics",
    "step_time_ratio",
    "to_golden_schema",
    "write_metrics",
]

LM_LOSS = "lm loss"
NUM_ZEROS = "num-zeros"
GRAD_NORM = "grad-norm"
ITERATION_TIME = "iteration-time"
MEM_ALLOCATED = "mem-allocated-bytes"
MEM_MAX_ALLOCATED = "mem-max-allocated-bytes"
MEM_MAX_RSS = "mem-max-rss-bytes"


def memory_metrics() -> dict[str, float]:
    """GPU: allocated / max allocated bytes of this device; CPU: peak RSS bytes of this process."""
    if torch.cuda.is_available():
        return {
            MEM_ALLOCATED: float(torch.cuda.memory_allocated()),
            MEM_MAX_ALLOCATED: float(torch.cuda.max_memory_allocated()),
        }
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {MEM_MAX_RSS: float(kib if sys.platform == "darwin" else kib * 1024)}


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one training step reports (on the rank that holds the loss)."""

    step: int
    loss: float
    grad_norm: float | None
    num_zeros: float | None
    seconds: float
    learning_rate: float
    memory: dict[str, float] = field(default_factory=dict)
    stability: dict[str, float] = field(default_factory=dict)
    """The mHC stability monitor's metrics of this step (`mhc_core.monitor.METRICS`), on mHC runs."""
    extra: dict[str, float] = field(default_factory=dict)
    """Further losses of this step under Megatron's names (`mtp_1 loss`, ...)."""

    def metrics(self) -> dict[str, float]:
        out = {LM_LOSS: self.loss, ITERATION_TIME: self.seconds}
        if self.grad_norm is not None:
            out[GRAD_NORM] = self.grad_norm
        if self.num_zeros is not None:
            out[NUM_ZEROS] = self.num_zeros
        out.update(self.extra)
        out.update(self.memory)
        out.update(self.stability)
        return out


def progress_line(rec: StepRecord, total: int) -> str:
    """Megatron's log line: ` iteration 3/24 | elapsed time per iteration (ms): 41.2 | lm loss: ...`."""
    parts = [
        f" iteration {rec.step:>8d}/{total:>8d}",
        f"elapsed time per iteration (ms): {rec.seconds * 1e3:.1f}",
        f"learning rate: {rec.learning_rate:.6E}",
        f"lm loss: {rec.loss:.6E}",
    ]
    if rec.grad_norm is not None:
        parts.append(f"grad norm: {rec.grad_norm:.3f}")
    if rec.num_zeros is not None:
        parts.append(f"num zeros: {rec.num_zeros:.0f}")
    if rec.stability:
        parts.append(
            f"mhc amax gain: {rec.stability['mhc-amax-gain-fwd']:.4f}/{rec.stability['mhc-amax-gain-bwd']:.4f}"
        )
    return " | ".join(parts) + " |"


def to_golden_schema(records: Sequence[StepRecord]) -> dict[str, dict]:
    """`{metric: {start_step, end_step, step_interval: 1, values: {"step": v}}}` (Megatron's schema)."""
    series: dict[str, dict[int, float]] = {}
    for rec in records:
        for name, value in rec.metrics().items():
            series.setdefault(name, {})[rec.step] = float(value)
    return {
        name: {
            "start_step": min(v),
            "end_step": max(v),
            "step_interval": 1,
            "values": {str(s): v[s] for s in sorted(v)},
        }
        for name, v in series.items()
    }


def write_metrics(path: Path, records: Sequence[StepRecord]) -> Path:
    """Write the golden-schema metrics of `records` to `path` atomically (full float precision)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_golden_schema(records), indent=1, allow_nan=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    """`{metric: {step: value}}` from a metrics file written by `write_metrics`."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    return {name: {int(s): float(v) for s, v in m["values"].items()} for name, m in doc.items()}


def step_time_ratio(mhc: Mapping[int, float], baseline: Mapping[int, float], *, skip: int = 3) -> float:
    """min(mHC iteration time) / min(baseline iteration time) over the steps both have, skipping
    the first `skip` (warm-up) steps. The minimum (best-of, as `timeit` reports) is the estimator
    least disturbed by other processes on a shared machine, where the two runs start seconds apart."""
    steps = sorted(set(mhc) & set(baseline))[skip:]
    if not steps:
        raise ValueError(
            f"no common iteration-time steps after skipping {skip} (mHC {len(mhc)}, baseline {len(baseline)})"
        )
    num = min(mhc[s] for s in steps)
    den = min(baseline[s] for s in steps)
    if not (math.isfinite(num) and math.isfinite(den)) or den <= 0:
        raise ValueError(f"step times not usable: mHC {num!r} s, baseline {den!r} s")
    return num / den
