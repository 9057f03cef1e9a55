"""The stability monitor: the paper's Amax gain and the constraint's health, measured in a training run.

Every `every` steps, on the first `tokens` tokens of the step's first forward, it records each
`HyperConnectionModule`'s H_res (a forward hook, registered only on sampled steps, so the others
cost nothing) and reports (`StabilityReport`):

- the composite Amax gain over the whole stack, forward (max absolute row sum of the product of the
  applied mixing matrices) and backward (max absolute column sum), sublayers in the order they ran
  (attention and MLP unrolled) and pipeline stages joined in order across the ranks of `group`
  (with virtual stages, chunk v of pipeline rank r is stage v * P + r);
- the worst single-sublayer gain and the sublayer it belongs to;
- the worst deviation of H_res's row and column sums from 1;
- the orientation check: the matrix each sublayer's `post_residual_bda` really applies (probed
  through the module's own ops, fused or not, with basis streams) against the one its variant says
  (`H` or `H^T`): a kernel that mixes transposed shows here even where the gain does not;
- the monitor's own cost on that step, in seconds.

A `MonitorConfig` bound turns a value into an alarm: warned once per kind with sublayer, step
and value, or raised (`StabilityAlarm`). `log_report` writes a report through a TensorBoard
`SummaryWriter` and / or a W&B run (megatron-core's usual writers) under `mhc/...` tags.
Megatron-free: any module tree holding `HyperConnectionModule` s works, and also a Megatron-LM tree's own
`HyperConnectionModule` (main's or dev's: found by its `n`, `hidden_size` and `fused_h_res_h_post_bda`,
whose forward returns `(aggregated, h_res, h_post, residual)` as ours): its applied matrix is probed through
its own `fused_h_res_h_post_bda`; it claims no variant, so its orientation error is not measured.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from mhc_core.module import HyperConnectionModule
from mhc_core.variants import ResidualConstraint, get_variant

__all__ = [
    "METRICS",
    "MonitorConfig",
    "StabilityAlarm",
    "StabilityMonitor",
    "StabilityReport",
    "is_tree_module",
    "log_report",
]

METRICS = {
    "forward_gain": "mhc-amax-gain-fwd",
    "backward_gain": "mhc-amax-gain-bwd",
    "worst_layer_gain": "mhc-layer-gain-max",
    "sum_deviation": "mhc-sum-dev-max",
    "orientation_error": "mhc-orientation-err",
    "sublayers": "mhc-monitor-sublayers",
    "seconds": "mhc-monitor-seconds",
}
"""Report field -> the metric name a training run records (golden schema, TensorBoard tag under `mhc/`)."""


class StabilityAlarm(RuntimeError):
    """A monitored value crossed its bound (`MonitorConfig.on_alarm="raise"`)."""


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """When the monitor samples and what trips its alarm (a bound of None: no alarm on that value)."""

    every: int = 10
    """Sample steps where `step % every == 0`."""
    tokens: int = 64
    """Tokens sampled per sublayer (the first ones of `[s*b]`)."""
    max_forward_gain: float | None = 2.0
    max_backward_gain: float | None = 2.0
    max_sum_deviation: float | None = 1e-3
    """Bound on `max |row sum - 1|` and `max |col sum - 1|` of any sampled H_res."""
    max_orientation_error: float | None = 1e-3
    """Bound on `max |applied - expected|` of the mixing matrices (a transposed mix)."""
    on_alarm: Literal["warn", "raise"] = "warn"

    def __post_init__(self) -> None:
        for name in ("every", "tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MonitorConfig.{name}={v!r} must be an integer >= 1")
        for name in ("max_forward_gain", "max_backward_gain", "max_sum_deviation", "max_orientation_error"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"MonitorConfig.{name}={v!r} must be None or a number > 0")
        if self.on_alarm not in ("warn", "raise"):
            raise ValueError(f"MonitorConfig.on_alarm={self.on_alarm!r} must be 'warn' or 'raise'")


@dataclass(frozen=True, kw_only=True)
class StabilityReport:
    """One sampled step (see the module docstring)."""

    step: int
    forward_gain: float
    backward_gain: float
    worst_layer_gain: float
    worst_layer: str
    sum_deviation: float
    orientation_error: float
    sublayers: int
    tokens: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """`{metric name: value}` (`METRICS`)."""
        return {name: float(getattr(self, field)) for field, name in METRICS.items()}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _gains(m: torch.Tensor) -> tuple[float, float]:
    """`(forward, backward)` Amax gain of `[T, n, n]` applied matrices (max over tokens)."""
    a = m.abs()
    return float(a.sum(-1).amax()), float(a.sum(-2).amax())


def is_tree_module(m: nn.Module) -> bool:
    """A Megatron-LM tree's hyper connection (main or dev), told by what it has, not by where it comes from."""
    return (
        not isinstance(m, HyperConnectionModule)
        and type(m).__name__ == "HyperConnectionModule"
        and callable(getattr(m, "fused_h_res_h_post_bda", None))
        and isinstance(getattr(m, "n", None), int)
        and isinstance(getattr(m, "hidden_size", None), int)
    )


class StabilityMonitor:
    """Samples the mHC stack of `model` (a module or model chunks) every `config.every` steps.

    Use::

        monitor = StabilityMonitor(model, MonitorConfig(every=10))
        with monitor.sampling(step):       # arms the hooks on sampled steps only
            loss = train_step(...)
        report = monitor.report(step, group=pp_group)   # None on steps not sampled
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module], config: MonitorConfig | None = None):
        self.config = config or MonitorConfig()
        chunks = [model] if isinstance(model, nn.Module) else list(model)
        self.chunks = len(chunks)
        self.modules: list[tuple[str, Any]] = []  # ours (HyperConnectionModule) or a tree's (is_tree_module)
        self._chunk_of: dict[str, int] = {}
        for i, chunk in enumerate(chunks):
            for name, m in chunk.named_modules():
                if isinstance(m, HyperConnectionModule) or is_tree_module(m):
                    key = f"{i}.{name}" if len(chunks) > 1 else name
                    self.modules.append((key, m))
                    self._chunk_of[key] = i
        self._captured: dict[str, torch.Tensor] = {}
        self._step: int | None = None
        self._hook_seconds = 0.0
        self._warned: set[str] = set()

    def sampled(self, step: int) -> bool:
        return step % self.config.every == 0

    @contextmanager
    def sampling(self, step: int) -> Iterator[None]:
        """Within the block, the first forward of each sublayer on a sampled `step` is recorded."""
        if not self.sampled(step) or not self.modules:
            yield
            return
        self._captured, self._step, self._hook_seconds = {}, step, 0.0
        handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        def hook(module, args, output):
            if name in self._captured:  # later microbatches, recompute forwards
                return
            t0 = time.perf_counter()
            h_res = output[1].detach()
            self._captured[name] = (
                h_res.reshape(-1, module.n, module.n)[: self.config.tokens].to(torch.float64).clone()
            )
            self._hook_seconds += time.perf_counter() - t0

        return hook

    def _applied(self, name: str, module: Any, h_res: torch.Tensor) -> torch.Tensor:
        """`[T, n, n]`: the matrix the module's n-stream update applies, probed with basis streams (`y = 0`,
        `h_post = 0`) through its own ops (`post_residual_bda`, a tree's `fused_h_res_h_post_bda`); needs C >= n."""
        t, n, c = h_res.shape[0], module.n, module.hidden_size
        weight = next(module.parameters())
        dev, dt = weight.device, weight.dtype
        basis = torch.zeros(t, 1, n, c, device=dev, dtype=dt)
        basis[:, 0, :, :n] = torch.eye(n, device=dev, dtype=dt)
        args = (
            h_res.to(dev, dt).view(t, 1, n, n),
            basis.view(t, 1, n * c),
            torch.zeros(t, 1, n, device=dev, dtype=dt),
            (torch.zeros(t, 1, c, device=dev, dtype=dt), None),
        )
        with torch.no_grad():
            if isinstance(module, HyperConnectionModule):
                out = module.post_residual_bda(*args, dropout_p=0.0, training=False)
            else:
                out = module.fused_h_res_h_post_bda(*args, 0.0, False, False)
        return out.view(t, n, c)[:, :, :n].to(torch.float64)  # out_i[j] = M[i, j]

    def report(self, step: int, *, group: Any = None) -> StabilityReport | None:
        """The report of a sampled `step` (None otherwise), stages joined over `group` (the pipeline
        group; every rank of it must call this); alarms fire here."""
        distributed = (
            group is not None
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1
        )
        if not self.sampled(step) or not (self.modules or distributed):
            return None  # (a stage without mHC sublayers still joins the gather of its pipeline group)
        if self.modules and (self._step != step or len(self._captured) != len(self.modules)):
            missing = [n for n, _ in self.modules if n not in self._captured]
            raise RuntimeError(
                f"StabilityMonitor.report(step={step}): no forward of {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''} was sampled (run the step inside "
                f"monitor.sampling({step}))"
            )
        t0 = time.perf_counter()
        captured, self._captured = self._captured, {}  # nothing of the step outlives its report
        composites: list[torch.Tensor | None] = [None] * self.chunks  # per model chunk (virtual stage)
        worst, worst_name, sum_dev, orient = 0.0, "", 0.0, 0.0
        for name, module in self.modules:
            h = captured[name]
            ours = isinstance(module, HyperConnectionModule)
            expected = h  # a tree's module claims no variant: what it applies is what it is checked by
            if ours:
                spec = get_variant(module.hc_config.variant)
                expected = h.transpose(-1, -2) if spec.res_transposed else h
            if module.hidden_size >= module.n:
                applied = self._applied(name, module, h)
                if ours:
                    orient = max(orient, float((applied - expected).abs().max()))
            else:
                applied = expected
            if not ours or module.hc_config.h_res_constraint == ResidualConstraint.SINKHORN:
                sum_dev = max(sum_dev, float((h.sum(-1) - 1).abs().max()), float((h.sum(-2) - 1).abs().max()))
            g = max(_gains(applied))
            if g > worst:
                worst, worst_name = g, name
            i = self._chunk_of[name]
            prev = composites[i]
            composites[i] = applied if prev is None else applied @ prev
        local = (
            [c.cpu() for c in composites if c is not None],
            worst,
            worst_name,
            sum_dev,
            orient,
            len(self.modules),
        )
        ranks = [local]
        if distributed:
            ranks = [None] * torch.distributed.get_world_size(group)  # type: ignore[list-item]  # filled by the gather
            torch.distributed.all_gather_object(ranks, local, group=group)
        if not any(r[0] for r in ranks):
            return None
        # Stage order: chunk v of pipeline rank r is virtual stage v * P + r (one chunk per rank without VPP).
        ordered = [r[0][v] for v in range(max(len(r[0]) for r in ranks)) for r in ranks if v < len(r[0])]
        total = ordered[0]
        for c in ordered[1:]:
            total = c.to(total.dtype) @ total
        stages = ranks
        fwd, bwd = _gains(total)
        best = max(stages, key=lambda s: s[1])
        rep = StabilityReport(
            step=step,
            forward_gain=fwd,
            backward_gain=bwd,
            worst_layer_gain=best[1],
            worst_layer=best[2],
            sum_deviation=max(s[3] for s in stages),
            orientation_error=max(s[4] for s in stages),
            sublayers=sum(s[5] for s in stages),
            tokens=int(total.shape[0]),
            seconds=self._hook_seconds + time.perf_counter() - t0,
        )
        self._alarm(rep)
        return rep

    def _alarm(self, rep: StabilityReport) -> None:
        c = self.config
        checks = (
            ("forward composite Amax gain", rep.forward_gain, c.max_forward_gain, ""),
            ("backward composite Amax gain", rep.backward_gain, c.max_backward_gain, ""),
            ("row / column sum deviation from 1", rep.sum_deviation, c.max_sum_deviation, ""),
            (
                "mixing-matrix orientation error",
                rep.orientation_error,
                c.max_orientation_error,
                " (a sublayer applies another matrix than its variant's H or H^T: a transposed mix?)",
            ),
        )
        for what, value, bound, hint in checks:
            if bound is None or not value > bound:
                continue
            msg = (
                f"mHC stability alarm at step {rep.step}: {what} {value:.6g} > bound {bound:g}; worst "
                f"sublayer {rep.worst_layer} (single-layer gain {rep.worst_layer_gain:.6g}){hint}"
            )
            if c.on_alarm == "raise":
                raise StabilityAlarm(msg)
            if what not in self._warned:
                self._warned.add(what)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)


def log_report(rep: StabilityReport, *, tensorboard: Any = None, wandb: Any = None) -> None:
    """Write `rep` through a TensorBoard `SummaryWriter` (`add_scalar`) and / or a W&B run
    (`log`) as `mhc/<metric>` at `rep.step`; either may be None (megatron's getters return None
    when the writer is off)."""
    values = {f"mhc/{k}": v for k, v in rep.metrics().items()}
    if tensorboard is not None:
        for tag, v in values.items():
            tensorboard.add_scalar(tag, v, rep.step)
    if wandb is not None:
        wandb.log(values, step=rep.step)
