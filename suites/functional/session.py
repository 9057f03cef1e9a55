"""The functional suite's session state: each case's launches (cached) and the step-time ratios.

Every launch is cached for the session, so the golden test, the ckpt-resume test and the
mHC-vs-baseline tests share one run per case; `--mhc-case` (recalibration) runs only what its
test needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from suites.functional.recipe import RECIPE_DIR, Recipe, load_recipe
from suites.functional.runner import RunResult, run_case, run_ckpt_resume

__all__ = ["STEP_TIME_RATIO", "FunctionalRuns"]

STEP_TIME_RATIO = pytest.StashKey[dict[str, float]]()
"""`{"gpt_tp1_pp1_mhc / gpt_tp1_pp1": ratio}`, printed in the terminal summary."""


class FunctionalRuns:
    """The session's launches, one per (case, variant), started on first use."""

    def __init__(self, root: Path, hw: str):
        self.root, self.hw = root, hw
        self._runs: dict[str, RunResult] = {}
        self.data_dir = root / "data"

    def recipe(self, case: str) -> Recipe:
        return load_recipe(RECIPE_DIR / f"{case}.yaml")

    def skip_reason(self, case: str) -> str | None:
        """Why `case` cannot run here, or None."""
        recipe = self.recipe(case)
        if self.hw not in recipe.hardware:
            where = ", ".join(f"{k} ({h.nproc} ranks, {h.backend}, {h.dtype})" for k, h in recipe.hardware.items())
            return f"{case}: the recipe has no HARDWARE entry for {self.hw}; it runs on {where}"
        spec = recipe.hardware[self.hw]
        if spec.backend == "nccl" and torch.cuda.device_count() < spec.nproc:
            return f"{case}: needs {spec.nproc} GPUs on {self.hw}, {torch.cuda.device_count()} visible"
        return None

    def deterministic_run(self, case: str) -> RunResult:
        """The session's run of `case`; skips the calling test when the case cannot run here or its
        recipe does not promise bitwise-reproducible runs on this hardware."""
        reason = self.skip_reason(case)
        if reason:
            pytest.skip(reason)
        run = self.run(case)
        if not run.plan.deterministic:
            pytest.skip(f"{case} is not deterministic on {self.hw} (recipe HARDWARE entry)")
        return run

    def run(self, case: str) -> RunResult:
        """The session's run of `case` (a ckpt-resume case saves its checkpoints on the way)."""
        if case not in self._runs:
            save = self.root / case / "checkpoints" if self.recipe(case).test_type == "ckpt-resume" else None
            self._runs[case] = run_case(case, self.hw, work_dir=self.root / case / "run", data_dir=self.data_dir,
                                        save=save)
        return self._runs[case]

    def resumed(self, case: str) -> RunResult:
        """The second launch of a ckpt-resume case, from the checkpoint at N/2 of `run(case)`."""
        key = f"{case}:resumed"
        if key not in self._runs:
            first = self.run(case)
            self._runs[key] = run_ckpt_resume(first, self.root / case / "checkpoints", self.root / case / "resumed",
                                              data_dir=self.data_dir)
        return self._runs[key]

    def fresh(self, case: str, tag: str, overrides: dict[str, Any] | None = None) -> RunResult:
        """A new launch of `case` (never cached), e.g. a second run or a deliberately broken one."""
        return run_case(case, self.hw, work_dir=self.root / case / tag, data_dir=self.data_dir, overrides=overrides)
