"""Launch a script under `torchrun` in a subprocess with a timeout; never leave a process behind.

A crashed rank fails the launch with that rank's stderr; a hung run is killed (its whole process
group) at the timeout, also with every rank's stderr tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LaunchError", "LaunchResult", "launch", "rank_logs"]

_TAIL = 4000


class LaunchError(RuntimeError):
    """A torchrun launch failed (non-zero exit or timeout); the message carries rank stderr."""

    def __init__(self, message: str, result: LaunchResult):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True, kw_only=True)
class LaunchResult:
    """What a launch left: exit code, combined output, the per-rank log dir, wall time."""

    returncode: int
    output: str
    log_dir: Path
    seconds: float
    timed_out: bool


def rank_logs(log_dir: Path) -> dict[int, str]:
    """`{rank: stderr text}` from torchrun's `--log-dir` layout (`<run>/attempt_*/<rank>/stderr.log`)."""
    out: dict[int, str] = {}
    for f in sorted(Path(log_dir).glob("**/stderr.log")):
        try:
            rank = int(f.parent.name)
        except ValueError:
            continue
        out[rank] = f.read_text(errors="replace")
    return out


def _kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.05)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    nproc: int,
    timeout: float,
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> LaunchResult:
    """Run `torchrun --standalone --nproc-per-node nproc script args` and wait at most `timeout` s.

    Every rank's stdout/stderr is redirected into `log_dir` (and tee'd to the combined output).
    On a non-zero exit or a timeout, raises `LaunchError` (when `check`) whose message names the
    failing ranks and shows the tail of their stderr. The whole process group is killed on the way
    out, so no rank outlives the call.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        f"--log-dir={log_dir}", "--redirects=3", "--tee=3", str(script), *map(str, args),
    ]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, start_new_session=True, text=True
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        output, _ = proc.communicate()
    finally:
        _kill_group(proc)
    result = LaunchResult(
        returncode=proc.returncode, output=output or "", log_dir=log_dir,
        seconds=time.monotonic() - start, timed_out=timed_out,
    )
    if check and (timed_out or proc.returncode != 0):
        raise LaunchError(_describe(script, nproc, timeout, result), result)
    return result


def _describe(script, nproc: int, timeout: float, result: LaunchResult) -> str:
    logs = rank_logs(result.log_dir)
    head = (
        f"torchrun {Path(script).name} ({nproc} ranks) timed out after {timeout:.0f} s and was killed"
        if result.timed_out
        else f"torchrun {Path(script).name} ({nproc} ranks) exited with code {result.returncode}"
    )
    failing = [r for r, text in logs.items() if "Traceback" in text or "Error" in text]
    parts = [head + (f"; failing ranks: {failing}" if failing else "")]
    for rank in failing or sorted(logs):
        parts.append(f"--- rank {rank} stderr (tail) ---\n{logs[rank][-_TAIL:]}")
    if not logs:
        parts.append(f"--- torchrun output (tail) ---\n{result.output[-_TAIL:]}")
    return "\n".join(parts)
