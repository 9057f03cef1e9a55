"""Launch `pp_worker.py` under torchrun (gloo on CPU) with a timeout."""

from __future__ import annotations

from pathlib import Path

from harness.launch.torchrun import LaunchResult, launch
from harness.upstream.megatron_tree import tree_env

WORKER = Path(__file__).with_name("pp_worker.py")
TIMEOUT = 180.0


# The ranks run on the CPU with gloo on every machine. On a GPU machine they must not see CUDA:
# `cpu_support` (the CPU workarounds) applies only where CUDA is absent, and megatron-core's p2p
# and schedules would otherwise put their buffers on the GPU beside a CPU model.
RANK_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def run_worker(
    out: Path, nproc: int, args: list[str], timeout: float = TIMEOUT, *, tree: Path | None = None
) -> LaunchResult:
    """Run the worker into `out`, its ranks on the CPU (`RANK_ENV`; with `tree`, the tree's megatron:
    `tree_env`); raises `LaunchError` with the failing ranks' stderr."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**RANK_ENV, **(tree_env(tree) if tree is not None else {})}
    return launch(
        WORKER, ["--out", str(out), *args], nproc=nproc, timeout=timeout, log_dir=out / "logs", env=env
    )
