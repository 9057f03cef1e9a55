"""torchrun's multi-node settings as one config, and what a failed rendezvous looks like.

`Rendezvous` holds what torchrun needs to join several agents (one per node) into one job: the
number of nodes, the backend (`c10d`: elastic, ranks by join order; `static`: fixed node ranks),
the endpoint `host:port` of the store that the host node serves, the run id and the join timeout.
`torchrun_args` turns it into torchrun's flags. Around a launch:

- `check_port_free` refuses to start a host node whose endpoint port is taken (an error that names
  the endpoint), instead of torchrun's silent fall-back to a client of whoever holds the port;
- `JoinWatcher` polls the c10d store while agents join, so that a rendezvous that times out can say
  how many of the nodes had joined (torchrun itself prints only `RendezvousTimeoutError`);
- `diagnose` reads an agent's output for a rendezvous timeout or a taken port.
"""

from __future__ import annotations

import base64
import errno
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

__all__ = [
    "JoinWatcher",
    "Rendezvous",
    "RendezvousBackend",
    "check_port_free",
    "diagnose",
    "split_endpoint",
]

_TIMEOUT_MARK = "RendezvousTimeoutError"
_UNREACHABLE_MARK = "RendezvousConnectionError"
_PORT_MARKS = ("address already in use", "EADDRINUSE", "errno: 98")


class RendezvousBackend(StrEnum):
    """torchrun's `--rdzv-backend`."""

    C10D = "c10d"
    """Elastic rendezvous over a TCPStore on the host node; ranks follow the join order."""
    STATIC = "static"
    """Fixed node ranks (`--node-rank`); the node of rank 0 serves the store."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`"host:port"` -> `(host, port)`; `ValueError` naming the endpoint."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous endpoint {endpoint!r} must be host:port with a port in 1..65535")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """One agent's share of a multi-node torchrun job."""

    nnodes: int
    endpoint: str
    """`host:port` of the rendezvous store (the first node of the allocation)."""
    run_id: str = "mhc"
    """`--rdzv-id`: agents with the same id join one job (Slurm: the job id)."""
    backend: RendezvousBackend = RendezvousBackend.C10D
    node_rank: int | None = None
    """This node's rank: required by `static`; with `c10d` only a label (ranks follow the join order)."""
    is_host: bool | None = None
    """c10d: whether this agent serves the store; None lets torchrun match the endpoint's host name."""
    join_timeout: float = 600.0
    """Seconds the agents wait for all `nnodes` to join before the job fails."""

    def __post_init__(self) -> None:
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"Rendezvous.nnodes={self.nnodes!r} must be an integer >= 1")
        split_endpoint(self.endpoint)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(self.run_id)):
            raise ValueError(f"Rendezvous.run_id={self.run_id!r} must be letters, digits, '_', '.' or '-'")
        object.__setattr__(self, "backend", RendezvousBackend(self.backend))
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"Rendezvous.node_rank={self.node_rank!r} must be in 0..{self.nnodes - 1}")
        if self.backend is RendezvousBackend.STATIC and self.node_rank is None:
            raise ValueError("Rendezvous.node_rank is required with the static backend")
        if not self.join_timeout > 0:
            raise ValueError(f"Rendezvous.join_timeout={self.join_timeout!r} must be > 0 seconds")

    @property
    def node(self) -> str:
        """A label for reports: `node<rank>`, or the endpoint's host for an unranked c10d agent."""
        return f"node{self.node_rank}" if self.node_rank is not None else f"agent of {self.endpoint}"

    @property
    def hosts_store(self) -> bool:
        """Whether this agent serves the store (and so needs the endpoint's port free here)."""
        if self.backend is RendezvousBackend.STATIC:
            return self.node_rank == 0
        return bool(self.is_host)

    def torchrun_args(self) -> list[str]:
        """The torchrun flags of this agent (no restarts: a failure ends the job)."""
        timeout = f"{self.join_timeout:g}"
        args = [
            f"--nnodes={self.nnodes}",
            f"--rdzv-backend={self.backend.value}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            "--max-restarts=0",
        ]
        if self.backend is RendezvousBackend.STATIC:
            return [*args, f"--node-rank={self.node_rank}", f"--rdzv-conf=timeout={timeout}"]
        conf = f"join_timeout={timeout},read_timeout={timeout}"
        if self.is_host is not None:
            conf += f",is_host={int(self.is_host)}"
        return [*args, f"--rdzv-conf={conf}"]


def check_port_free(endpoint: str) -> None:
    """Raise `OSError` naming `endpoint` when its port cannot be bound on this machine."""
    host, port = split_endpoint(endpoint)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if family == socket.AF_INET else "::", port))
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"rendezvous endpoint {endpoint}: port {port} is already in use on this "
                f"machine ({exc.strerror}); free it or pick another --rdzv-endpoint port",
            ) from None


def diagnose(output: str, rdzv: Rendezvous, joined: int | None) -> str | None:
    """A one-line cause from an agent's output: a rendezvous timeout, an unreachable store or a taken
    port; None otherwise."""
    if _TIMEOUT_MARK in output:
        count = (
            f"{joined} of {rdzv.nnodes}" if joined is not None else f"an unknown number of the {rdzv.nnodes}"
        )
        return (
            f"rendezvous {rdzv.run_id} at {rdzv.endpoint} timed out after {rdzv.join_timeout:g} s: "
            f"{count} nodes joined"
        )
    if _UNREACHABLE_MARK in output:
        return (
            f"rendezvous {rdzv.run_id}: the store at {rdzv.endpoint} did not answer within {rdzv.join_timeout:g} s "
            f"(has the host node, node rank 0, started?): 0 of {rdzv.nnodes} nodes joined"
        )
    low = output.lower()
    if any(mark.lower() in low for mark in _PORT_MARKS) or f"[Errno {errno.EADDRINUSE}]" in output:
        return (
            f"rendezvous endpoint {rdzv.endpoint}: its port is already in use (the store could not bind it)"
        )
    return None


class JoinWatcher(threading.Thread):
    """Counts the nodes in a c10d rendezvous while agents join, until `stop()` or completion.

    `joined` is the largest count seen (participants plus those waiting), or None when the store
    never answered. The polling runs in a child process (`python -m harness.launch.rendezvous`), so that
    torch's C++ warnings about a store going away stay out of this process's output.
    """

    def __init__(self, rdzv: Rendezvous, *, interval: float = 0.5):
        super().__init__(daemon=True, name=f"rdzv-watch-{rdzv.run_id}")
        self.rdzv, self.interval = rdzv, interval
        self.joined: int | None = None
        self.complete = False
        self._proc: subprocess.Popen | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.join(timeout=5)

    def run(self) -> None:
        if self.rdzv.backend is not RendezvousBackend.C10D or self._stopped.is_set():
            return
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "FATAL"}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness.launch.rendezvous",
                self.rdzv.endpoint,
                self.rdzv.run_id,
                str(self.interval),
                f"{self.rdzv.join_timeout + 60:g}",
                str(os.getpid()),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        if self._stopped.is_set():  # stop() came while the child started: it saw no child to kill
            self._proc.kill()
        assert self._proc.stdout is not None  # stdout=PIPE
        for line in self._proc.stdout:
            count, _, state = line.strip().partition(" ")
            if count.isdigit():
                self.joined = max(self.joined or 0, int(count))
                self.complete = state == "complete"
        self._proc.wait()


def _poll(endpoint: str, run_id: str, interval: float, lifetime: float, parent: int) -> None:
    """Print `<joined> <open|complete>` whenever the count of rendezvous `run_id` changes; return
    when it completes, the store goes away, the parent process is gone, or after `lifetime`
    seconds (the child process of `JoinWatcher`, which outlives no launch; `parent`: the pid of the
    process that started it, so that a parent gone before this one started is noticed too)."""
    import time
    from datetime import timedelta

    if os.getppid() != parent:  # the launcher is already gone: nothing to watch for
        return
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # noqa: F401  (unpickling)

    host, port = split_endpoint(endpoint)
    key, store, last = f"torch.rendezvous.{run_id}", None, None
    deadline = time.monotonic() + lifetime
    while os.getppid() == parent and time.monotonic() < deadline:
        try:
            if store is None:
                with socket.create_connection((host, port), timeout=1):
                    pass
                store = dist.TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False
                )
            if store.check([key]):
                try:
                    state = pickle.loads(base64.b64decode(store.get(key)))
                except (
                    pickle.UnpicklingError,
                    EOFError,
                    ValueError,
                ):  # the backend's "no state yet" sentinel
                    state = None
                if state is not None:
                    now = (
                        len(state.participants) + len(state.wait_list),
                        "complete" if state.complete else "open",
                    )
                    if now != last:
                        print(*now, flush=True)
                        last = now
                    if state.complete:
                        return
        except Exception:
            if store is not None:  # the host went away
                return
        time.sleep(interval)


if __name__ == "__main__":
    _poll(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
