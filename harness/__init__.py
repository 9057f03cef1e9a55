"""mHC verification harness: hardware keys, golden values, comparison lanes, recalibration,
reports, perf history, the `mhc-harness` CLI and the pytest plugin.

Rooms: `golden/` (the store, its lanes, hardware keys and fingerprints, recalibration), `perf/` (history, pages,
tables), `upstream/` (a Megatron-LM tree and installed trees), `launch/` (starting ranks), `training/` (what runs
in a rank), `peers/` (the adapters), `conformance/` (the checks over them); the CLI, the suite runner, the
pytest plugin, the report and its plots at the root.

Public names are imported lazily (the pytest plugin loads this package in every pytest run, so
importing it must stay cheap). Layout: `golden/<hw>/<suite>/<case>.json` (+ `.meta.json`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.golden.compare import (
        ApproximateCheck,
        CheckResult,
        ExactCheck,
        TimingCheck,
        allowed_misses,
        compare,
        upstream_checks,
    )
    from harness.golden.errors import (
        GoldenError,
        GoldenFormatError,
        LockTimeoutError,
        MetaError,
        MissingGoldenError,
        NonFiniteError,
        RecalibrationError,
        UnknownHardwareError,
    )
    from harness.golden.hardware import HardwareKey, detect_hardware
    from harness.golden.recalibrate import recalibrate
    from harness.golden.results import CaseOutcome
    from harness.golden.schema import Golden, MetricSeries, load_golden, series_from_list
    from harness.golden.store import GoldenStore
    from harness.plots import plot_overlay

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
    "ApproximateCheck": "harness.golden.compare",
    "CheckResult": "harness.golden.compare",
    "ExactCheck": "harness.golden.compare",
    "TimingCheck": "harness.golden.compare",
    "allowed_misses": "harness.golden.compare",
    "compare": "harness.golden.compare",
    "upstream_checks": "harness.golden.compare",
    "CaseOutcome": "harness.golden.results",
    "Golden": "harness.golden.schema",
    "MetricSeries": "harness.golden.schema",
    "load_golden": "harness.golden.schema",
    "series_from_list": "harness.golden.schema",
    "GoldenError": "harness.golden.errors",
    "GoldenFormatError": "harness.golden.errors",
    "LockTimeoutError": "harness.golden.errors",
    "MetaError": "harness.golden.errors",
    "MissingGoldenError": "harness.golden.errors",
    "NonFiniteError": "harness.golden.errors",
    "RecalibrationError": "harness.golden.errors",
    "UnknownHardwareError": "harness.golden.errors",
    "GoldenStore": "harness.golden.store",
    "HardwareKey": "harness.golden.hardware",
    "detect_hardware": "harness.golden.hardware",
    "plot_overlay": "harness.plots",
    "recalibrate": "harness.golden.recalibrate",
}
"""Where each public name lives; imported on first use. The type checker reads the same names from the imports
under `TYPE_CHECKING` above, so `from harness import ExactCheck` is typed."""


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
