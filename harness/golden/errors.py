"""One exception hierarchy for every bad input the harness meets.

Every class derives from `GoldenError`, itself a `ValueError`, so callers can
catch the whole family at once. Messages always name the file and the numbers involved
(metric, step, line/column), and the code that raises never writes anything first.
"""

from __future__ import annotations

__all__ = [
    "GoldenError",
    "GoldenFormatError",
    "NonFiniteError",
    "MissingGoldenError",
    "MetaError",
    "UnknownHardwareError",
    "RecalibrationError",
    "LockTimeoutError",
]


class GoldenError(ValueError):
    """Base class: a golden, meta, result or history input the harness cannot use."""


class GoldenFormatError(GoldenError):
    """Malformed JSON or a document that does not follow Megatron's golden-value schema."""


class NonFiniteError(GoldenError):
    """NaN or +-inf in golden values (read or written), like upstream's check_golden_values."""


class MissingGoldenError(GoldenError):
    """No golden file for this hardware key; the message lists the keys that do exist."""


class MetaError(GoldenError):
    """A provenance sidecar (`<case>.meta.json`) is corrupt, partial or out of sync."""


class UnknownHardwareError(GoldenError):
    """A hardware key outside the known list, where a known one is required (recalibration)."""


class RecalibrationError(GoldenError):
    """A recalibration run failed or produced values that must not become golden."""


class LockTimeoutError(GoldenError):
    """The per-case lock could not be taken in time (another writer holds it)."""
