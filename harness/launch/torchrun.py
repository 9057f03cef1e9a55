"""Launch a script under `torchrun` in a subprocess with a timeout; never leave a process behind.

One node by default (`--standalone`); with a `harness.launch.rendezvous.Rendezvous` the agent joins a
multi-node job instead (c10d or static rendezvous), refusing a taken store port up front and naming
how many nodes had joined when the rendezvous times out. A crashed rank fails the launch with that
rank's stderr; a hung run is killed (its whole process group) at the timeout, also with every rank's
stderr tail. `harness.launch.nodes` starts several agents on one machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.launch.rendezvous import JoinWatcher, Rendezvous, check_port_free, diagnose

__all__ = [
    "LaunchError",
    "LaunchResult",
    "failed_ranks",
    "kill_group",
    "launch",
    "live_pids",
    "rank_logs",
    "torchrun_command",
    "worker_env",
]

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
    cause: str | None = None
    """A rendezvous diagnosis (`harness.launch.rendezvous.diagnose`), when the launch failed in the rendezvous."""


def rank_logs(log_dir: Path) -> dict[int, str]:
    """`{rank: stderr text}` of the newest launch in torchrun's `--log-dir` layout
    (`<run>/attempt_*/<rank>/stderr.log`; a directory reused by several launches holds several runs)."""
    files = [f for f in Path(log_dir).glob("**/attempt_*/*/stderr.log") if f.parent.name.isdigit()]
    if not files:
        return {}
    runs = {f.parents[2] for f in files}
    newest = max(runs, key=lambda d: d.stat().st_mtime)
    return {
        int(f.parent.name): f.read_text(errors="replace") for f in sorted(files) if f.parents[2] == newest
    }


def live_pids(*needles: str) -> list[int]:
    """Running processes whose command line holds every one of `needles` (e.g. a worker script and its
    output directory): what a test checks to know that no rank or agent outlived its launch."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            if all(n in cmd for n in needles):
                pids.append(int(proc.name))
    return pids


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the process group of `proc` (started with `start_new_session`)."""
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


def torchrun_command(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    nproc: int,
    log_dir: Path,
    rendezvous: Rendezvous | None = None,
) -> list[str]:
    """The torchrun command line: `--standalone` on one node, else the rendezvous's flags."""
    where = ["--standalone"] if rendezvous is None else rendezvous.torchrun_args()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        f"--log-dir={log_dir}",
        "--redirects=3",
        "--tee=3",
        str(script),
        *map(str, args),
    ]


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with one BLAS thread per rank, unbuffered output, and `env` on top."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    return full_env


def launch(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    nproc: int,
    timeout: float,
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    check: bool = True,
    rendezvous: Rendezvous | None = None,
) -> LaunchResult:
    """Run `torchrun --nproc-per-node nproc script args` and wait at most `timeout` s.

    One node (`--standalone`) unless `rendezvous` says which multi-node job this agent joins; a host
    agent whose store port is taken raises `OSError` naming the endpoint before anything starts.
    Every rank's stdout/stderr is redirected into `log_dir` (and tee'd to the combined output).
    On a non-zero exit or a timeout, raises `LaunchError` (when `check`) whose message names the
    failing ranks and shows the tail of their stderr (or the rendezvous's failure: how many nodes
    joined before its timeout). The whole process group is killed on the way out, so no rank
    outlives the call.
    """
    if rendezvous is not None and rendezvous.hosts_store:
        check_port_free(rendezvous.endpoint)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(script, args, nproc=nproc, log_dir=log_dir, rendezvous=rendezvous)
    watcher = JoinWatcher(rendezvous) if rendezvous is not None else None
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=worker_env(env),
        start_new_session=True,
        text=True,
    )
    if watcher is not None:
        watcher.start()
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        output, _ = proc.communicate()
    finally:
        kill_group(proc)
        if watcher is not None:
            watcher.stop()
    output = output or ""
    failed = timed_out or proc.returncode != 0
    joined = watcher.joined if watcher is not None else None
    cause = diagnose(output, rendezvous, joined) if failed and rendezvous is not None else None
    result = LaunchResult(
        returncode=proc.returncode,
        output=output,
        log_dir=log_dir,
        seconds=time.monotonic() - start,
        timed_out=timed_out,
        cause=cause,
    )
    if check and failed:
        raise LaunchError(_describe(script, nproc, timeout, result, rendezvous), result)
    return result


_FAILURE_ROW = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


_ROOT_CAUSE = "Root Cause (first observed failure)"


def failed_ranks(output: str) -> list[tuple[int, int, int]]:
    """`[(rank, local_rank, exitcode)]` from torchrun's failure table (`ChildFailedError`) in `output`,
    the root cause (torchrun's first observed failure) first."""
    head, _, root = output.rpartition(_ROOT_CAUSE) if _ROOT_CAUSE in output else ("", "", output)
    rows = [(int(r), int(lr), int(code)) for r, lr, code in _FAILURE_ROW.findall(root)]
    return rows + [
        row
        for row in ((int(r), int(lr), int(c)) for r, lr, c in _FAILURE_ROW.findall(head))
        if row not in rows
    ]


def _describe(
    script, nproc: int, timeout: float, result: LaunchResult, rendezvous: Rendezvous | None = None
) -> str:
    logs = rank_logs(result.log_dir)
    where = (
        f"{nproc} ranks"
        if rendezvous is None
        else f"{nproc} ranks on {rendezvous.node} of {rendezvous.nnodes} nodes"
    )
    head = (
        f"torchrun {Path(script).name} ({where}) timed out after {timeout:.0f} s and was killed"
        if result.timed_out
        else f"torchrun {Path(script).name} ({where}) exited with code {result.returncode}"
    )
    if result.cause:  # the ranks never started (or never got the store): the agent's output says why
        return f"{head}: {result.cause}\n--- torchrun output (tail) ---\n{result.output[-_TAIL:]}"
    failing = [r for r, text in logs.items() if "Traceback" in text or "Error" in text]
    which = "ranks" if rendezvous is None else "local ranks"
    parts = [head + (f"; failing {which}: {failing}" if failing else "")]
    if rendezvous is not None:
        parts += [
            f"rank {r} (local rank {lr}) exited with code {code}"
            for r, lr, code in failed_ranks(result.output)
        ]
    for rank in failing or sorted(logs):
        parts.append(f"--- {which[:-1]} {rank} stderr (tail) ---\n{logs[rank][-_TAIL:]}")
    if not logs:
        parts.append(f"--- torchrun output (tail) ---\n{result.output[-_TAIL:]}")
    return "\n".join(parts)
