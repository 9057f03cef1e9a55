"""The functional suite's session state: each case's launches (cached) and the step-time ratios.

Every launch is cached for the session, so the golden test, the ckpt-resume test and the
mHC-vs-baseline tests share one run per case; `--mhc-case` (recalibration) runs only what its
test needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.launch.runs import RunResult, plan_case, run_case, run_ckpt_resume
from harness.training.numerics import CpuNumerics
from harness.training.recipe import RECIPE_DIR, Recipe, RunPlan, load_recipe

__all__ = [
    "MULTINODE_TIMES",
    "PLANT_ENV_VAR",
    "RETAINED_BYTES",
    "STEP_TIME_RATIO",
    "FunctionalRuns",
    "planted_overrides",
]

STEP_TIME_RATIO = pytest.StashKey[dict[str, float]]()
"""`{"gpt_tp1_pp1_mhc / gpt_tp1_pp1": ratio}`, printed in the terminal summary."""

MULTINODE_TIMES = pytest.StashKey[dict[str, tuple[float, float]]]()
"""`{case: (two-agent seconds, one-node seconds)}` of test_multinode, printed in the terminal summary."""

RETAINED_BYTES = pytest.StashKey[dict[str, tuple[int, int, float]]]()
"""`{shape (case): (bytes the first step left over all ranks, bytes megatron-core keeps after the last check,
seconds the checks took)}` of test_retention, printed in the terminal summary."""

PLANT_ENV_VAR = "MHC_FUNCTIONAL_TEST_OVERRIDES"
"""Test hook: a JSON object of MODEL_ARGS overrides planted into every cached run of the session (a
regression planted into a whole main job, `test_other_machine.py`); each run says so when it starts."""


def planted_overrides(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The overrides `$MHC_FUNCTIONAL_TEST_OVERRIDES` plants (empty when unset); `ValueError` naming it."""
    raw = (os.environ if env is None else env).get(PLANT_ENV_VAR, "")
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{PLANT_ENV_VAR}={raw!r} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not all(isinstance(k, str) and k.startswith("--") for k in doc):
        raise ValueError(
            f"{PLANT_ENV_VAR}={raw!r} must be a JSON object of MODEL_ARGS flags, e.g. "
            '{"--lr-warmup-iters": 3}'
        )
    return doc


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
            where = ", ".join(
                f"{k} ({h.nproc} ranks, {h.backend}, {h.dtype})" for k, h in recipe.hardware.items()
            )
            return f"{case}: the recipe has no HARDWARE entry for {self.hw}; it runs on {where}"
        spec = recipe.hardware[self.hw]
        if spec.backend == "nccl" and spec.nnodes > 1:
            return (
                f"{case}: {spec.nnodes} nodes x {spec.nproc} GPUs on {self.hw}; run it across nodes with "
                "ci/slurm/functional.sbatch (docs/functional.md, 'Several nodes')"
            )
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

    def plan(self, case: str) -> RunPlan:
        """The resolved plan of `case` on this session's hardware (with any planted overrides)."""
        return plan_case(case, self.hw, data_dir=self.data_dir, overrides=planted_overrides() or None)

    def checkpoints(self, case: str) -> Path:
        """Where the session's run of a ckpt-resume `case` saves its checkpoints."""
        return self.root / case / "checkpoints"

    def run(self, case: str) -> RunResult:
        """The session's run of `case` (a ckpt-resume case saves its checkpoints on the way)."""
        if case not in self._runs:
            save = self.checkpoints(case) if self.recipe(case).test_type == "ckpt-resume" else None
            planted = planted_overrides()
            if planted:
                print(f"[functional] {case}: MODEL_ARGS planted by ${PLANT_ENV_VAR}: {planted}", flush=True)
            self._runs[case] = run_case(
                case,
                self.hw,
                work_dir=self.root / case / "run",
                data_dir=self.data_dir,
                save=save,
                overrides=planted or None,
            )
        return self._runs[case]

    def resumed(self, case: str) -> RunResult:
        """The second launch of a ckpt-resume case, from the checkpoint at N/2 of `run(case)`."""
        key = f"{case}:resumed"
        if key not in self._runs:
            first = self.run(case)
            self._runs[key] = run_ckpt_resume(
                first, self.checkpoints(case), self.root / case / "resumed", data_dir=self.data_dir
            )
        return self._runs[key]

    def fresh(
        self,
        case: str,
        tag: str,
        overrides: dict[str, Any] | None = None,
        numerics: CpuNumerics | None = None,
    ) -> RunResult:
        """A new launch of `case` (never cached), e.g. a second run, a deliberately broken one, or one
        under another CPU numerics profile."""
        return run_case(
            case,
            self.hw,
            work_dir=self.root / case / tag,
            data_dir=self.data_dir,
            overrides=overrides,
            numerics=numerics,
        )
