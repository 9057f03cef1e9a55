"""Megatron-LM's golden-value schema: parse, validate, build and dump.

A golden document is one JSON object keyed by metric name, nothing else::

    {"lm loss": {"start_step": 1, "end_step": 50, "step_interval": 1,
                 "values": {"1": 10.91234, "2": 10.90011, ...}}, ...}

Upstream's `golden_values_*.json` files load unchanged. Choices made here:

* Values are stored at full float64 precision (`repr` round-trips exactly); nothing is
  rounded, so a deterministic run compares equal to the file it wrote.
* Steps may be absent from the `start_step + k * step_interval` grid (upstream main omits
  unobserved steps), but every present step must lie on it.
* NaN and +-inf are rejected when read and when written, naming file, metric and step.
  Older Megatron files hold the *string* `"nan"` for the unlogged first `iteration-time`
  step; `parse_golden` rejects it too unless `allow_nan_strings=True` (legacy import
  only), which drops such steps as unobserved, as upstream main does.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from types import MappingProxyType
from typing import Any

from harness.golden.errors import GoldenFormatError, NonFiniteError

__all__ = [
    "Golden",
    "MetricSeries",
    "check_finite",
    "dumps_golden",
    "golden_digest",
    "golden_from_doc",
    "load_golden",
    "parse_golden",
    "read_text",
    "parse_json",
    "series_from_list",
    "to_golden",
]

_HEADER = ("start_step", "end_step", "step_interval")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class MetricSeries:
    """One metric: `values[step] = value` on the grid `start_step + k * step_interval`."""

    start_step: int
    end_step: int
    step_interval: int
    values: Mapping[int, float]
    """Read-only mapping, sorted by step."""

    def __post_init__(self) -> None:
        for name in _HEADER:
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name}={v!r} must be an int")
        if self.start_step < 0:
            raise ValueError(f"start_step={self.start_step} must be >= 0")
        if self.step_interval < 1:
            raise ValueError(f"step_interval={self.step_interval} must be >= 1")
        if self.end_step < self.start_step:
            raise ValueError(f"end_step={self.end_step} must be >= start_step={self.start_step}")
        if not self.values:
            raise ValueError("values must hold at least one step")
        clean: dict[int, float] = {}
        for step in sorted(self.values):
            if not _is_int(step):
                raise ValueError(f"values: step {step!r} must be an int")
            off = step - self.start_step
            if step > self.end_step or off < 0 or off % self.step_interval:
                raise ValueError(
                    f"values: step {step} is off the grid start_step={self.start_step}, "
                    f"end_step={self.end_step}, step_interval={self.step_interval}"
                )
            clean[int(step)] = float(self.values[step])
        object.__setattr__(self, "values", MappingProxyType(clean))

    @property
    def steps(self) -> tuple[int, ...]:
        """The present steps, ascending."""
        return tuple(self.values)

    @classmethod
    def from_steps(cls, values: Mapping[int, float]) -> MetricSeries:
        """Build a series from `{step: value}`; the interval is the gcd of the gaps (as upstream main)."""
        if not values:
            raise ValueError("values must hold at least one step")
        steps = sorted(int(s) for s in values)
        gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        interval = reduce(math.gcd, gaps, 0) or 1
        return cls(
            start_step=steps[0],
            end_step=steps[-1],
            step_interval=interval,
            values={int(s): float(v) for s, v in values.items()},
        )

    def to_json(self) -> dict[str, Any]:
        """The schema dict (step keys as strings)."""
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "step_interval": self.step_interval,
            "values": {str(s): v for s, v in self.values.items()},
        }


Golden = dict[str, MetricSeries]
"""A golden document (or a set of actual values in the same shape): metric name -> series."""


def series_from_list(values: Sequence[float], *, start_step: int = 1, step_interval: int = 1) -> MetricSeries:
    """Build a series from per-step values: `values[i]` is step `start_step + i * step_interval`."""
    if len(values) == 0:
        raise ValueError("values must hold at least one step")
    steps = {start_step + i * step_interval: float(v) for i, v in enumerate(values)}
    return MetricSeries(start_step=start_step, end_step=max(steps), step_interval=step_interval, values=steps)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _key_lines(text: str, key: str) -> list[int]:
    """The lines of `text` where `key` is written as an object key (as `json.dumps` spells it)."""
    pattern = re.compile(re.escape(json.dumps(key)) + r"\s*:")
    return [text.count("\n", 0, m.start()) + 1 for m in pattern.finditer(text)]


def parse_json(text: str, *, source: str) -> Any:
    """`json.loads` whose errors name `source` and the line/column position."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise GoldenFormatError(
            f"{source}: malformed JSON at line {exc.lineno} column {exc.colno} (char {exc.pos}): {exc.msg}"
        ) from None
    except _DuplicateKey as exc:
        lines = _key_lines(text, exc.key)
        shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
        where = f" (the key is written at lines {shown})" if len(lines) > 1 else ""
        raise GoldenFormatError(f"{source}: duplicate key {exc.key!r} in one object{where}") from None


def _parse_metric(name: str, raw: Any, *, source: str, allow_nan_strings: bool) -> MetricSeries:
    where = f"{source}: metric {name!r}"
    if not isinstance(raw, dict):
        raise GoldenFormatError(
            f"{where}: expected an object with {', '.join(_HEADER)}, values; got {type(raw).__name__} "
            "(a golden file holds metric names only at top level)"
        )
    missing = [k for k in (*_HEADER, "values") if k not in raw]
    extra = sorted(set(raw) - {*_HEADER, "values"})
    if missing or extra:
        parts = ([f"missing keys {missing}"] if missing else []) + (
            [f"unexpected keys {extra}"] if extra else []
        )
        raise GoldenFormatError(f"{where}: {', '.join(parts)}")
    for k in _HEADER:
        if not _is_int(raw[k]):
            raise GoldenFormatError(f"{where}: {k}={raw[k]!r} must be an integer")
    if not isinstance(raw["values"], dict):
        raise GoldenFormatError(f"{where}: values must be an object {{step: number}}")
    values: dict[int, float] = {}
    for key, v in raw["values"].items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise GoldenFormatError(f"{where}: step key {key!r} is not a non-negative integer")
        step = int(key)
        if isinstance(v, str) and v.strip().lower() == "nan":
            if allow_nan_strings:
                continue
            raise NonFiniteError(
                f"{where} step {step}: value is the string {v!r} (NaN); golden values must be finite. "
                "Legacy Megatron files store the unlogged first iteration-time step this way: "
                "import them with allow_nan_strings=True (mhc-harness import-megatron; "
                "mhc-harness diff --allow-nan-strings), which drops such steps"
            )
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise GoldenFormatError(f"{where} step {step}: value {v!r} is not a number")
        if not math.isfinite(v):
            raise NonFiniteError(
                f"{where} step {step}: value {v!r} is not finite; golden values must be finite"
            )
        values[step] = float(v)
    if not values:
        raise GoldenFormatError(f"{where}: no finite values")
    try:
        return MetricSeries(
            start_step=raw["start_step"],
            end_step=raw["end_step"],
            step_interval=raw["step_interval"],
            values=values,
        )
    except ValueError as exc:
        raise GoldenFormatError(f"{where}: {exc}") from None


def parse_golden(text: str, *, source: str, allow_nan_strings: bool = False) -> Golden:
    """Parse and validate a golden document; errors name `source`, metric and step."""
    return golden_from_doc(
        parse_json(text, source=source), source=source, allow_nan_strings=allow_nan_strings
    )


def golden_from_doc(doc: Any, *, source: str, allow_nan_strings: bool = False) -> Golden:
    """Validate an already-parsed golden document (`parse_json`'s result) into a `Golden`."""
    if not isinstance(doc, dict) or not doc:
        raise GoldenFormatError(f"{source}: expected a non-empty JSON object keyed by metric name")
    return {
        name: _parse_metric(name, raw, source=source, allow_nan_strings=allow_nan_strings)
        for name, raw in doc.items()
    }


def read_text(path: str | Path) -> str:
    """A golden (or result) file's text; `GoldenFormatError` naming it when it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise GoldenFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_golden(path: str | Path, *, allow_nan_strings: bool = False) -> Golden:
    """Read and validate a golden (or result) file in Megatron's schema."""
    return parse_golden(read_text(path), source=str(path), allow_nan_strings=allow_nan_strings)


def check_finite(golden: Mapping[str, MetricSeries], *, source: str) -> None:
    """Raise `NonFiniteError` naming `source`, metric and step at the first NaN/inf."""
    for name, series in golden.items():
        for step, v in series.values.items():
            if not math.isfinite(v):
                raise NonFiniteError(
                    f"{source}: metric {name!r} step {step}: value {v!r} is not finite; "
                    "refusing to write non-finite golden values"
                )


def dumps_golden(golden: Mapping[str, MetricSeries], *, target: str = "golden values") -> str:
    """Serialise to Megatron's schema (metric keys only, full precision); rejects NaN/inf."""
    if not golden:
        raise GoldenFormatError(f"{target}: nothing to write (no metrics)")
    for name, series in golden.items():
        if not isinstance(name, str) or not name:
            raise GoldenFormatError(f"{target}: metric name {name!r} must be a non-empty string")
        if not isinstance(series, MetricSeries):
            raise GoldenFormatError(
                f"{target}: metric {name!r} is a {type(series).__name__}, not a MetricSeries"
            )
    check_finite(golden, source=target)
    return json.dumps({n: s.to_json() for n, s in golden.items()}, indent=2, allow_nan=False) + "\n"


def golden_digest(golden: Mapping[str, MetricSeries]) -> str:
    """sha256 of the canonical serialisation: stable across whitespace or line-ending changes."""
    canon = json.dumps({n: s.to_json() for n, s in golden.items()}, sort_keys=True, allow_nan=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def _to_series(name: str, raw: Any, *, source: str) -> MetricSeries:
    if isinstance(raw, MetricSeries):
        return raw
    if hasattr(raw, "tolist") and not isinstance(raw, Mapping):  # numpy array, torch tensor
        raw = raw.tolist()
    try:
        if isinstance(raw, Mapping) and "values" in raw:
            missing = [k for k in _HEADER if k not in raw]
            if missing:
                raise ValueError(f"schema dict lacks {missing}")
            return MetricSeries(
                start_step=raw["start_step"],
                end_step=raw["end_step"],
                step_interval=raw["step_interval"],
                values={int(s): float(v) for s, v in raw["values"].items()},
            )
        if isinstance(raw, Mapping):
            return MetricSeries.from_steps({int(s): float(v) for s, v in raw.items()})
        if isinstance(raw, Sequence) and not isinstance(raw, str | bytes):
            return series_from_list([float(v) for v in raw])
    except (TypeError, ValueError) as exc:
        raise GoldenFormatError(f"{source}: metric {name!r}: {exc}") from None
    raise GoldenFormatError(
        f"{source}: metric {name!r}: expected {{step: value}}, a list of per-step values or the golden "
        f"schema; got {type(raw).__name__}"
    )


def to_golden(metrics: Mapping[str, Any], *, source: str = "actual metrics") -> Golden:
    """Normalise metrics handed over by a test into `Golden`.

    Each metric may be a `MetricSeries`, the schema dict, `{step: value}` or a list of
    per-step values (steps 1..N). NaN/inf are kept here; `check_finite` rejects them.
    """
    if not isinstance(metrics, Mapping) or not metrics:
        raise GoldenFormatError(f"{source}: expected a non-empty mapping metric -> values")
    return {str(name): _to_series(str(name), raw, source=source) for name, raw in metrics.items()}
