"""The pp suite's launches, batched by world size.

A launch's fixed cost (the torchrun agent, then each rank's imports of torch and megatron-core, its
process group and its exit: about 6 CPU-seconds per rank on a 2-core box) is most of a pp case's time
on a CPU, where its two training steps take under a second. `Batches` runs the cases a session will run
that share a world size in one launch (`pp_worker.py --batch`), on the first request for any of them:
each case still trains in its own directory with its own model-parallel state, seeds and trackers, and
its test reads only its own files. A batch that fails (a rank raised, or the launch timed out) leaves its
finished cases done; each unfinished case then runs alone when its test asks for it, so the error a test
reports is its own case's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from harness.launch.torchrun import LaunchError
from suites.pp.launch import TIMEOUT, run_worker

__all__ = ["BATCH_CASE_SECONDS", "Batches", "Planned"]

BATCH_CASE_SECONDS = 60.0
"""A batch's timeout: `launch.TIMEOUT` plus this much per case (a case takes 2-4 s of a batch on a 2-core
Zen 4 box)."""


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One run: its world size, its worker flags, and the runs whose files it reads (its `--init`)."""

    nproc: int
    args: tuple[str, ...]
    needs: tuple[str, ...] = ()


class Batches:
    """Runs keyed by name under `root/<name>/`, each on its first request; the planned runs of one world size
    go together in one launch (`batch=False`: each alone, as under xdist, where every worker holds every item).
    `before(name)` is called for each run a run `needs`, before the launch that runs it."""

    def __init__(
        self, root: Path, *, batch: bool = True, before: Callable[[str], object] | None = None
    ) -> None:
        self.root, self.batch, self.before = Path(root), batch, before
        self.planned: dict[str, Planned] = {}
        self.done: set[str] = set()
        self.failed: dict[str, Exception] = {}
        self._launched: set[int] = set()

    def plan(self, name: str, run: Planned) -> None:
        """Add a run (before any batch of its world size starts, else it runs alone); the same name twice must
        plan the same run."""
        if self.planned.setdefault(name, run) != run:
            raise ValueError(f"run {name!r} planned twice, differently: {self.planned[name]} and {run}")

    def __getitem__(self, name: str) -> Path:
        """The directory of run `name`, run first if needed; its launch's error (a `LaunchError`) if it failed."""
        if name in self.failed:  # a failed run is launched once, its error raised for each request
            raise self.failed[name]
        if name not in self.done:
            if name not in self.planned:
                raise KeyError(f"run {name!r} was not planned; planned: {sorted(self.planned)}")
            run = self.planned[name]
            if self.batch and run.nproc not in self._launched:
                self._launched.add(run.nproc)
                self._run_batch(
                    [n for n, r in self.planned.items() if r.nproc == run.nproc and n not in self.done]
                )
            if name not in self.done:
                self._run_alone(name)
        return self.root / name

    def _run_needs(self, name: str) -> None:
        """The runs `name` needs, through `before`; the error of one that failed."""
        if self.before is not None:
            for need in self.planned[name].needs:
                self.before(need)

    def _ready(self, names: Iterable[str]) -> list[str]:
        """Those of `names` whose needed runs succeed; the others run alone, later, and fail there."""
        ready = []
        for name in names:
            try:
                self._run_needs(name)
            except Exception:  # noqa: BLE001 - raised again by the run's own request
                continue
            ready.append(name)
        return ready

    def _run_batch(self, names: list[str]) -> None:
        names = self._ready(names)
        if len(names) < 2:
            return  # nothing to share: a lone run launches as itself
        nproc = self.planned[names[0]].nproc
        cases = []
        for name in names:
            out = self._fresh(name)
            cases.append({"out": str(out), "args": list(self.planned[name].args)})
        spec = self.root / f"batch-{nproc}ranks.json"
        spec.write_text(json.dumps(cases, indent=1) + "\n", encoding="utf-8")
        try:
            run_worker(
                self.root / f"batch-{nproc}ranks",
                nproc,
                ["--batch", str(spec)],
                timeout=TIMEOUT + BATCH_CASE_SECONDS * len(names),
            )
        except LaunchError:
            pass  # its finished cases count; the others run alone on request
        self.done.update(n for n in names if self._finished(n))

    def _run_alone(self, name: str) -> None:
        run = self.planned[name]
        try:
            self._run_needs(name)
            run_worker(self._fresh(name), run.nproc, list(run.args))
        except Exception as exc:
            self.failed[name] = exc
            raise
        self.done.add(name)

    def _fresh(self, name: str) -> Path:
        out = self.root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        return out

    def _finished(self, name: str) -> bool:
        """Every rank wrote its record and none wrote an error."""
        out, nproc = self.root / name, self.planned[name].nproc
        return all((out / f"rank{r}.pt").is_file() for r in range(nproc)) and not any(
            out.glob("error-rank*.txt")
        )
