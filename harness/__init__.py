"""mHC verification harness: hardware keys, golden values, comparison lanes, recalibration,
reports, perf history, the `mhc-harness` CLI and the pytest plugin.

Public names are imported lazily (the pytest plugin loads this package in every pytest run, so
importing it must stay cheap). Layout: `golden/<hw>/<suite>/<case>.json` (+ `.meta.json`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ApproximateCheck",
    "CaseOutcome",
    "CheckResult",
    "ExactCheck",
    "Golden",
    "GoldenError",
    "GoldenFormatError",
    "GoldenStore",
    "HardwareKey",
    "LockTimeoutError",
    "MetaError",
    "MetricSeries",
    "MissingGoldenError",
    "NonFiniteError",
    "RecalibrationError",
    "TimingCheck",
    "UnknownHardwareError",
    "allowed_misses",
    "compare",
    "detect_hardware",
    "load_golden",
    "plot_overlay",
    "recalibrate",
    "series_from_list",
    "upstream_checks",
]

_WHERE = {
    "ApproximateCheck": "compare", "CheckResult": "compare", "ExactCheck": "compare", "TimingCheck": "compare",
    "allowed_misses": "compare", "compare": "compare", "upstream_checks": "compare",
    "CaseOutcome": "results",
    "Golden": "schema", "MetricSeries": "schema", "load_golden": "schema", "series_from_list": "schema",
    "GoldenError": "errors", "GoldenFormatError": "errors", "LockTimeoutError": "errors", "MetaError": "errors",
    "MissingGoldenError": "errors", "NonFiniteError": "errors", "RecalibrationError": "errors",
    "UnknownHardwareError": "errors",
    "GoldenStore": "store",
    "HardwareKey": "hardware", "detect_hardware": "hardware",
    "plot_overlay": "plots",
    "recalibrate": "recalibrate",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"harness.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
