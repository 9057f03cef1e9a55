"""Progress of a pytest run, as a small JSON file another process can poll.

The plugin (`--mhc-progress-file PATH`) keeps `{"total", "done", "failed", "skipped",
"failures": [nodeid...], "finished"}` up to date in PATH, rewritten atomically after every test;
under xdist only the controller writes. `ProgressPrinter` (`mhc-harness run`) reads it
while the pytest subprocess runs and prints one line per suite now and then: tests done / total,
failures so far, elapsed seconds, and each failure as it happens.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Progress", "ProgressPrinter", "ProgressWriter", "read_progress"]


@dataclass(kw_only=True)
class Progress:
    """Counts of one pytest run so far."""

    total: int | None = None
    done: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "skipped": self.skipped,
            "failures": self.failures,
            "finished": self.finished,
        }


def read_progress(path: Path) -> Progress | None:
    """The last state written to `path` (None before the first write or for a torn read)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return Progress(**doc)
    except (OSError, ValueError, TypeError):
        return None


class ProgressWriter:
    """Plugin side: counts reports and rewrites the file (atomically, by rename)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.state = Progress()
        self._failed: set[str] = set()
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.state.to_json()), encoding="utf-8")
        os.replace(tmp, self.path)

    def collected(self, n: int) -> None:
        self.state.total = max(self.state.total or 0, n)
        self._write()

    def report(self, nodeid: str, when: str, outcome: str) -> None:
        """One `pytest_runtest_logreport`: a test is done at its teardown report."""
        if outcome == "failed" and nodeid not in self._failed:
            self._failed.add(nodeid)
            self.state.failed += 1
            self.state.failures.append(f"{nodeid} ({when})")
        if outcome == "skipped" and when in ("setup", "call"):
            self.state.skipped += 1
        if when == "teardown":
            self.state.done += 1
        self._write()

    def finish(self) -> None:
        self.state.finished = True
        self._write()


class ProgressPrinter:
    """Runner side: polls the file and prints a line when the counts moved (at most every
    `every_s` seconds), a heartbeat after `heartbeat_s` without change, and each new failure."""

    def __init__(
        self,
        suite: str,
        path: Path,
        *,
        out: Callable[[str], None] = print,
        every_s: float = 10.0,
        heartbeat_s: float = 60.0,
    ) -> None:
        self.suite, self.path, self.out = suite, Path(path), out
        self.every_s, self.heartbeat_s = every_s, heartbeat_s
        self.start = time.monotonic()
        self._last_print = -1e9
        self._last_done: int | None = None
        self._failures_seen = 0

    def line(self, p: Progress | None, *, final: bool = False) -> str:
        elapsed = time.monotonic() - self.start
        if p is None:
            return f"[{self.suite}] {'no progress recorded' if final else 'collecting ...'} {elapsed:.0f} s"
        total = "?" if p.total is None else str(p.total)
        return (
            f"[{self.suite}] {'done: ' if final else ''}{p.done}/{total} tests, {p.failed} failed, "
            f"{p.skipped} skipped, {elapsed:.0f} s"
        )

    def poll(self, *, final: bool = False) -> None:
        p = read_progress(self.path)
        now = time.monotonic()
        if p is not None:
            for f in p.failures[self._failures_seen :]:
                self.out(f"[{self.suite}] FAILED {f}")
            self._failures_seen = len(p.failures)
        moved = p is not None and p.done != self._last_done
        if (
            final
            or (moved and now - self._last_print >= self.every_s)
            or now - self._last_print >= self.heartbeat_s
        ):
            self.out(self.line(p, final=final))
            self._last_print = now
            self._last_done = p.done if p is not None else None
