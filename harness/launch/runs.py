"""Launch a functional case under `torchrun` and collect its metrics.

`run_case` resolves a recipe for a hardware key, builds the indexed dataset it names (a setup
step, from the text the repository ships), writes the run plan, starts `worker.py` with
`harness.launch.torchrun.launch` (gloo on CPU, NCCL on GPU; a timeout kills the whole launch), echoes
the progress lines of the rank that holds the loss while it runs, and returns the metrics that
rank wrote (Megatron's golden schema). `run_ckpt_resume` is upstream's ckpt-resume flow.

A plan of several nodes (`nnodes`) runs as that many torchrun agents on this machine
(`harness.launch.nodes`, a c10d rendezvous on 127.0.0.1); on a cluster each node runs its own
agent instead (`run_node`, driven by `harness/launch/multinode.py` and `ci/slurm/`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.launch.nodes import launch_nodes
from harness.launch.rendezvous import Rendezvous, check_port_free
from harness.launch.torchrun import LaunchResult, launch
from harness.training.checkpoint import rewind_tracker
from harness.training.data import ensure_indexed_dataset
from harness.training.metrics import read_metrics
from harness.training.numerics import CpuNumerics
from harness.training.recipe import RECIPE_DIR, RunPlan, dump_plan, load_recipe, resolve

__all__ = [
    "CRASH_RANK_ENV_VAR",
    "REPO_ROOT",
    "WORKER",
    "RunResult",
    "plan_case",
    "run_case",
    "run_ckpt_resume",
    "prepare_out_dir",
    "run_node",
    "run_plan",
]

WORKER = Path(__file__).resolve().parents[1] / "training" / "worker.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
CRASH_RANK_ENV_VAR = "MHC_FUNCTIONAL_TEST_CRASH_RANK"
"""Test hook: the global rank that raises right after joining the process group (worker.py)."""
DATA_VARIABLE = "FUNCTIONAL_DATA"
"""`${FUNCTIONAL_DATA}` in MODEL_ARGS: where the runner builds the indexed datasets."""


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One launch: its plan, the metrics `{metric: {step: value}}`, wall seconds, output dir, and the
    numerics fingerprint of the rank that computed the metrics (`NumericsFingerprint.to_json`)."""

    plan: RunPlan
    metrics: dict[str, dict[int, float]]
    seconds: float
    out_dir: Path
    fingerprint: dict[str, Any]


def plan_case(
    case: str,
    hw: str,
    *,
    data_dir: Path,
    overrides: Mapping[str, Any] | None = None,
    recipe_dir: Path = RECIPE_DIR,
    numerics: CpuNumerics | None = None,
) -> RunPlan:
    """The resolved plan of `recipes/<case>.yaml` on `hw` (CPU runs under the `numerics` profile)."""
    recipe = load_recipe(recipe_dir / f"{case}.yaml")
    return resolve(
        recipe, hw, variables={DATA_VARIABLE: str(data_dir)}, overrides=overrides, numerics=numerics
    )


def _tail(log_dir: Path, stop: threading.Event, echo: Callable[[str], None]) -> None:
    """Echo the progress lines (only the rank that holds the loss prints them) from torchrun's
    per-rank stdout logs under `log_dir`, one agent's or several nodes', while they grow."""
    offsets: dict[Path, int] = {}
    while True:
        done = stop.is_set()
        for path in sorted(log_dir.glob("**/attempt_*/*/stdout.log")):
            with path.open(encoding="utf-8", errors="replace") as f:
                f.seek(offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offsets[path] = offsets.get(path, 0) + len(complete.encode("utf-8"))
            for line in complete.splitlines():
                if " iteration " in line:
                    echo(line)
        if done:
            return
        stop.wait(0.25)


@contextlib.contextmanager
def _echoing(log_dir: Path, echo: Callable[[str], None]) -> Iterator[None]:
    """Echo the progress lines under `log_dir` (`_tail`, in a thread) while the block runs, and the last
    ones after it."""
    stop = threading.Event()
    tail = threading.Thread(target=_tail, args=(log_dir, stop, echo), daemon=True)
    tail.start()
    try:
        yield
    finally:
        stop.set()
        tail.join(timeout=5)


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def prepare_out_dir(plan: RunPlan, out_dir: Path, data_dir: Path, plan_name: str = "plan.json") -> list[str]:
    """Build the plan's dataset, write the plan into `out_dir`; the worker's arguments."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not plan.args.mock_data:
        ensure_indexed_dataset(plan.args.data_path)
    plan_file = dump_plan(plan, out_dir / plan_name)
    return [str(x) for x in ("--plan", plan_file, "--out", out_dir, "--data-cache", data_dir / "cache")]


def _worker_env(plan: RunPlan) -> dict[str, str]:
    return {
        **plan.env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }


def _describe_plan(plan: RunPlan) -> str:
    ranks = f"{plan.nnodes} nodes x {plan.nproc} ranks" if plan.nnodes > 1 else f"{plan.nproc} rank(s)"
    return (
        f"{plan.case} on {plan.hw}: {ranks}, {plan.backend}, TP{plan.args.tensor_model_parallel_size} "
        f"PP{plan.args.pipeline_model_parallel_size} DP{plan.data_parallel_size}, {plan.args.train_iters} iterations"
    )


def run_plan(
    plan: RunPlan,
    out_dir: Path,
    *,
    data_dir: Path,
    save: Path | None = None,
    load: Path | None = None,
    echo: Callable[[str], None] | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    worker_args: Sequence[str] = (),
) -> RunResult | None:
    """Launch `plan` into `out_dir`; raises `LaunchError` (with the failing ranks' stderr) on failure.
    A plan of `nnodes > 1` runs as that many torchrun agents on this machine (c10d on 127.0.0.1).
    `env` adds to the ranks' environment (test hooks, a Megatron-LM tree's path); `worker_args` to the
    worker's (`--tree-flavor`, `--init`, `--dump-init`: a dump returns None, it trains nothing, unless
    `--then-train` follows it)."""
    if save is not None and importlib.util.find_spec("psutil") is None:
        raise RuntimeError(
            f"{plan.case}: saving a torch_dist checkpoint needs psutil (megatron-core 0.16.1's "
            "filesystem_async writer imports it without declaring it); install the test extra"
        )
    args = [*prepare_out_dir(plan, out_dir, data_dir), *map(str, worker_args)]
    if save is not None:
        args += ["--save", str(save)]
    if load is not None:
        args += ["--load", str(load)]
    env = {**_worker_env(plan), **(env or {})}
    echo = echo or _print
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    echo(f"[functional] {_describe_plan(plan)}" + (f", resuming from {load}" if load else ""))
    start = time.monotonic()
    with _echoing(log_dir, echo):
        if plan.nnodes > 1:
            launch_nodes(
                WORKER,
                args,
                nnodes=plan.nnodes,
                nproc=plan.nproc,
                timeout=timeout or plan.timeout,
                log_dir=log_dir,
                env=env,
                run_id=f"{plan.case}-local",
            )
        else:
            launch(WORKER, args, nproc=plan.nproc, timeout=timeout or plan.timeout, log_dir=log_dir, env=env)
    seconds = time.monotonic() - start
    echo(f"[functional] {plan.case}: done in {seconds:.1f} s")
    if "--dump-init" in worker_args and "--then-train" not in worker_args:
        return None
    fingerprint = json.loads((out_dir / "fingerprint.json").read_text(encoding="utf-8"))
    return RunResult(
        plan=plan,
        metrics=read_metrics(out_dir / "metrics.json"),
        seconds=seconds,
        out_dir=out_dir,
        fingerprint=fingerprint,
    )


def run_node(
    plan: RunPlan,
    out_dir: Path,
    rendezvous: Rendezvous,
    *,
    data_dir: Path,
    echo: Callable[[str], None] | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchResult:
    """This node's agent of a multi-node run of `plan` (one call per node, e.g. one `srun` task each):
    `plan.nproc` ranks joining `rendezvous`; the rank that holds the loss writes `out_dir/metrics.json`
    (a directory every node sees). Logs go to `out_dir/logs/node<rank>`; raises `LaunchError`."""
    if rendezvous.nnodes != plan.nnodes:
        raise ValueError(
            f"{plan.case}: the rendezvous joins {rendezvous.nnodes} nodes, the plan has nnodes={plan.nnodes}"
        )
    if rendezvous.hosts_store:
        check_port_free(rendezvous.endpoint)
    label = rendezvous.node_rank if rendezvous.node_rank is not None else os.getpid()
    args = prepare_out_dir(plan, out_dir, data_dir, plan_name=f"plan.node{label}.json")
    echo = echo or _print
    log_dir = out_dir / "logs" / f"node{label}"
    echo(
        f"[functional] {_describe_plan(plan)}; {rendezvous.node} joins {rendezvous.run_id} at {rendezvous.endpoint}"
    )
    with _echoing(log_dir, echo):
        result = launch(
            WORKER,
            args,
            nproc=plan.nproc,
            timeout=timeout or plan.timeout,
            log_dir=log_dir,
            env={**_worker_env(plan), **(env or {})},
            rendezvous=rendezvous,
        )
    echo(f"[functional] {plan.case}: {rendezvous.node} done in {result.seconds:.1f} s")
    return result


def run_case(
    case: str,
    hw: str,
    *,
    work_dir: Path,
    data_dir: Path,
    overrides: Mapping[str, Any] | None = None,
    save: Path | None = None,
    echo: Callable[[str], None] | None = None,
    numerics: CpuNumerics | None = None,
) -> RunResult:
    """Resolve and run `case` on `hw` into `work_dir`."""
    plan = plan_case(case, hw, data_dir=data_dir, overrides=overrides, numerics=numerics)
    result = run_plan(plan, work_dir, data_dir=data_dir, save=save, echo=echo)
    assert result is not None  # only a weight dump returns none
    return result


def run_ckpt_resume(
    first: RunResult,
    checkpoints: Path,
    work_dir: Path,
    *,
    data_dir: Path,
    echo: Callable[[str], None] | None = None,
) -> RunResult:
    """Upstream's second ckpt-resume launch: rewind the tracker of `first`'s checkpoints to
    `--save-interval` (N/2), drop later checkpoints, and train from there to N."""
    resume_at = first.plan.args.save_interval
    if resume_at is None or resume_at >= first.plan.args.train_iters:
        raise ValueError(
            f"{first.plan.case}: --save-interval={resume_at} leaves nothing to resume "
            f"(--train-iters={first.plan.args.train_iters})"
        )
    rewind_tracker(checkpoints, resume_at)
    result = run_plan(first.plan, work_dir, data_dir=data_dir, load=checkpoints, echo=echo)
    assert result is not None  # only a weight dump returns none
    return result
