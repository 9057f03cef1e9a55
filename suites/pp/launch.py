"""Launch `pp_worker.py` under torchrun (gloo on CPU) with a timeout."""

from __future__ import annotations

from pathlib import Path

from harness.torchrun import LaunchResult, launch

WORKER = Path(__file__).with_name("pp_worker.py")
TIMEOUT = 180.0


def run_worker(out: Path, nproc: int, args: list[str], timeout: float = TIMEOUT) -> LaunchResult:
    """Run the worker into `out`; raises `LaunchError` with the failing ranks' stderr."""
    out.mkdir(parents=True, exist_ok=True)
    return launch(WORKER, ["--out", str(out), *args], nproc=nproc, timeout=timeout, log_dir=out / "logs")
