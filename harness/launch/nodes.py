"""Several torchrun agents on one machine, joined by a c10d rendezvous: "nodes" on one box.

`launch_nodes` starts `nnodes` agents of `nproc` ranks each on 127.0.0.1, exactly as a multi-node
job starts one agent per node (`harness.launch.rendezvous.Rendezvous`, c10d, node 0 serving the store).
Each agent logs under `log_dir/node<i>/` (its own output in `agent.log`, its ranks in torchrun's
layout). When one agent fails, the others are stopped, so the whole job ends; the error names the
node that failed first, the global and local rank from torchrun's failure table, and that rank's
stderr. A job past `timeout` is killed, every agent with its process group.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from harness.launch.rendezvous import JoinWatcher, Rendezvous, check_port_free, diagnose
from harness.launch.torchrun import (
    LaunchError,
    LaunchResult,
    failed_ranks,
    kill_group,
    rank_logs,
    torchrun_command,
    worker_env,
)

__all__ = ["NodesLaunchError", "NodesResult", "free_endpoint", "launch_nodes", "node_dirs"]

_TAIL = 4000


@dataclass(frozen=True, kw_only=True)
class NodesResult:
    """A multi-agent launch: one `LaunchResult` per node (in node order) and the job's wall time."""

    nodes: tuple[LaunchResult, ...]
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(n.returncode == 0 for n in self.nodes)


class NodesLaunchError(LaunchError):
    """A multi-agent launch failed; `result` is the failing node's launch, `nodes` every node's."""

    def __init__(self, message: str, nodes: NodesResult, failed_node: int | None):
        super().__init__(message, nodes.nodes[failed_node or 0])
        self.nodes, self.failed_node = nodes, failed_node


def free_endpoint(host: str = "127.0.0.1") -> str:
    """`host:port` with a port the OS just reported free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def node_dirs(log_dir: Path, nnodes: int) -> list[Path]:
    """The per-node log directories `log_dir/node<i>`."""
    return [Path(log_dir) / f"node{i}" for i in range(nnodes)]


def launch_nodes(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    nnodes: int,
    nproc: int,
    timeout: float,
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    endpoint: str | None = None,
    run_id: str = "mhc-local",
    join_timeout: float = 60.0,
    check: bool = True,
) -> NodesResult:
    """Run `script` as `nnodes` agents x `nproc` ranks on this machine; raises `LaunchError` (when
    `check`; a `NodesLaunchError`) naming the first failing node and rank, or the rendezvous that timed out.

    `endpoint` defaults to a free port on 127.0.0.1; a taken port raises `OSError` naming it before
    any agent starts.
    """
    endpoint = endpoint or free_endpoint()
    plans = [
        Rendezvous(
            nnodes=nnodes,
            endpoint=endpoint,
            run_id=run_id,
            node_rank=i,
            is_host=i == 0,
            join_timeout=join_timeout,
        )
        for i in range(nnodes)
    ]
    check_port_free(endpoint)
    dirs = node_dirs(Path(log_dir), nnodes)
    procs, files = [], []
    watcher = JoinWatcher(plans[0])
    start = time.monotonic()
    try:
        for rdzv, d in zip(plans, dirs, strict=True):
            d.mkdir(parents=True, exist_ok=True)
            out = (d / "agent.log").open("w", encoding="utf-8")
            files.append(out)
            cmd = torchrun_command(script, args, nproc=nproc, log_dir=d, rendezvous=rdzv)
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=worker_env(env),
                    start_new_session=True,
                    text=True,
                )
            )
        watcher.start()
        first_failed, timed_out = _wait(procs, start + timeout)
    finally:
        for p in procs:
            kill_group(p)
        watcher.stop()
        for f in files:
            f.close()
    seconds = time.monotonic() - start
    nodes = tuple(
        _node_result(p, d, rdzv, seconds=seconds, timed_out=timed_out, joined=watcher.joined)
        for p, d, rdzv in zip(procs, dirs, plans, strict=True)
    )
    if first_failed is not None:
        first_failed = _primary(nodes, first_failed)
    result = NodesResult(nodes=nodes, seconds=seconds, timed_out=timed_out)
    if check and not result.ok:
        raise NodesLaunchError(
            _describe(script, result, first_failed, plans, timeout, nproc), result, first_failed
        )
    return result


def _wait(procs: list[subprocess.Popen], deadline: float) -> tuple[int | None, bool]:
    """Wait until every agent exits, or one fails, or `deadline` passes: `(first failing agent, timed out)`.
    The caller then stops every agent still running."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return failed[0], False
        if all(c == 0 for c in codes):
            return None, False
        if time.monotonic() > deadline:
            return None, True
        time.sleep(0.1)


_COLLATERAL = ("Connection closed by peer", "Connection reset by peer")
"""What gloo raises on the ranks of a job whose other rank died: a consequence, not the cause."""


def _primary(nodes: tuple[LaunchResult, ...], first: int) -> int:
    """The node whose failure caused the others': `first` (the first seen to exit) unless its root cause
    reads as a consequence of a peer's death while another node that failed by itself has a real one."""

    def collateral(i: int) -> bool:
        rows = failed_ranks(nodes[i].output)
        if not rows:
            return False
        text = rank_logs(nodes[i].log_dir).get(rows[0][1], "")
        return any(mark in text for mark in _COLLATERAL)

    if not collateral(first):
        return first
    return next(
        (i for i, n in enumerate(nodes) if i != first and n.returncode > 0 and not collateral(i)), first
    )


def _node_result(
    proc: subprocess.Popen,
    log_dir: Path,
    rdzv: Rendezvous,
    *,
    seconds: float,
    timed_out: bool,
    joined: int | None,
) -> LaunchResult:
    """One agent's launch: its exit code and output, and the rendezvous's diagnosis when it failed."""
    output = (log_dir / "agent.log").read_text(encoding="utf-8", errors="replace")
    return LaunchResult(
        returncode=proc.returncode,
        output=output,
        log_dir=log_dir,
        seconds=seconds,
        timed_out=timed_out,
        cause=None if proc.returncode == 0 else diagnose(output, rdzv, joined),
    )


def _describe(
    script, result: NodesResult, first: int | None, plans: list[Rendezvous], timeout: float, nproc: int
) -> str:
    nnodes, name = len(plans), Path(script).name
    if result.timed_out:
        parts = [f"{name} on {nnodes} nodes timed out after {timeout:.0f} s; every agent was killed"]
        for i, node in enumerate(result.nodes):
            for rank, text in rank_logs(node.log_dir).items():
                parts.append(f"--- node{i} local rank {rank} stderr (tail) ---\n{text[-_TAIL:]}")
        return "\n".join(parts)
    assert first is not None  # a launch that neither timed out nor failed has nothing to describe
    node = result.nodes[first]
    others = [f"node{i}" for i in range(nnodes) if i != first]
    head = f"{name} on {nnodes} nodes: node{first} failed first (agent exit code {node.returncode})"
    if node.cause:
        head += f": {node.cause}"
    parts = [head + (f"; stopped {', '.join(others)}" if others else "")]
    rows = failed_ranks(node.output)
    logs = rank_logs(node.log_dir)
    if rows:
        rank, local_rank, code = rows[0]
        also = "; ".join(f"rank {r} (local rank {lr}) code {c}" for r, lr, c in rows[1:])
        parts.append(
            f"node{first} rank {rank} (local rank {local_rank}, group rank {rank // nproc}) exited with "
            f"code {code}, the first observed failure" + (f" (then {also})" if also else "")
        )
        shown = [lr for _, lr, _ in rows if logs.get(lr, "").strip()][:2]
        for lr in shown:
            r = next(r for r, x, _ in rows if x == lr)
            parts.append(f"--- node{first} rank {r} (local rank {lr}) stderr (tail) ---\n{logs[lr][-_TAIL:]}")
    if not rows:
        parts.append(f"--- node{first} agent output (tail) ---\n{node.output[-_TAIL:]}")
    return "\n".join(parts)
