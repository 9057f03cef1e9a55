"""Multi-node launch settings: torchrun's flags, bad settings, failure tables and diagnoses."""

from __future__ import annotations

import socket

import pytest

from harness.launch.rendezvous import Rendezvous, RendezvousBackend, check_port_free, diagnose, split_endpoint
from harness.launch.torchrun import failed_ranks, rank_logs, torchrun_command

# The failure table torchrun 2.13 printed when rank 3 (local rank 1) of a 2 x 2 job raised and the
# agent then stopped its sibling (suites/functional/test_multinode.py provokes the same).
FAILURE_TABLE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
worker.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_00:04:57
  host      : localhost
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 6527)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 6527
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_00:04:57
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 6528)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_c10d_flags_name_nodes_endpoint_id_and_timeouts():
    """A c10d agent gets torchrun's multi-node flags, no restarts, and its host role when given."""
    r = Rendezvous(
        nnodes=2, endpoint="10.0.0.1:29500", run_id="job-7", node_rank=1, is_host=False, join_timeout=30
    )
    assert r.torchrun_args() == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--rdzv-id=job-7",
        "--max-restarts=0",
        "--rdzv-conf=join_timeout=30,read_timeout=30,is_host=0",
    ]
    assert not r.hosts_store and r.node == "node1"


def test_static_flags_carry_the_node_rank():
    """The static backend needs a node rank; node 0 serves the store."""
    r = Rendezvous(nnodes=4, endpoint="h:1234", backend="static", node_rank=0, join_timeout=60)
    assert r.backend is RendezvousBackend.STATIC and r.hosts_store
    assert r.torchrun_args()[-2:] == ["--node-rank=0", "--rdzv-conf=timeout=60"]


def test_one_node_stays_standalone(tmp_path):
    """Without a rendezvous the command is today's `--standalone` one."""
    cmd = torchrun_command("w.py", ["--x"], nproc=4, log_dir=tmp_path)
    assert "--standalone" in cmd and not any(a.startswith("--nnodes") for a in cmd)
    multi = torchrun_command(
        "w.py",
        [],
        nproc=2,
        log_dir=tmp_path,
        rendezvous=Rendezvous(nnodes=2, endpoint="h:1", node_rank=0, is_host=True),
    )
    assert "--standalone" not in multi and "--nnodes=2" in multi and "--nproc-per-node=2" in multi


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"nnodes": 0}, r"nnodes=0 must be an integer >= 1", id="zero-nodes"),
        pytest.param({"endpoint": "host"}, r"endpoint 'host' must be host:port", id="no-port"),
        pytest.param({"endpoint": "host:70000"}, r"endpoint 'host:70000' must be host:port", id="port-range"),
        pytest.param({"run_id": "a b"}, r"run_id='a b'", id="run-id"),
        pytest.param({"node_rank": 2}, r"node_rank=2 must be in 0..1", id="rank-range"),
        pytest.param(
            {"backend": "static"}, r"node_rank is required with the static backend", id="static-no-rank"
        ),
        pytest.param({"backend": "etcd"}, r"'etcd' is not a valid RendezvousBackend", id="backend"),
        pytest.param({"join_timeout": 0}, r"join_timeout=0 must be > 0", id="timeout"),
    ],
)
def test_bad_settings_name_the_field(kwargs, message):
    """Each bad field is a ValueError naming it and its value."""
    with pytest.raises(ValueError, match=message):
        Rendezvous(**{"nnodes": 2, "endpoint": "127.0.0.1:29500", **kwargs})


def test_split_endpoint_accepts_ipv6_brackets():
    """`[::1]:29500` splits into host and port."""
    assert split_endpoint("[::1]:29500") == ("::1", 29500)


def test_failure_table_lists_the_root_cause_first():
    """torchrun's first observed failure comes first, then the ranks it took down."""
    assert failed_ranks(FAILURE_TABLE) == [(3, 1, 1), (2, 0, -15)]
    assert failed_ranks("no table here") == []


def test_diagnoses_name_the_count_the_store_and_the_port():
    """A timeout names how many nodes joined; an unreachable store names it; a taken port too."""
    r = Rendezvous(nnodes=2, endpoint="127.0.0.1:29500", run_id="j", join_timeout=8)
    assert (
        diagnose("... RendezvousTimeoutError\n", r, 1)
        == "rendezvous j at 127.0.0.1:29500 timed out after 8 s: 1 of 2 nodes joined"
    )
    assert "an unknown number of the 2 nodes joined" in diagnose("RendezvousTimeoutError", r, None)
    assert "0 of 2 nodes joined" in diagnose("RendezvousConnectionError: The connection", r, None)
    assert "127.0.0.1:29500: its port is already in use" in diagnose(
        "OSError: Address already in use", r, None
    )
    assert diagnose("RuntimeError: something else", r, 2) is None


def test_taken_port_is_refused_naming_the_endpoint():
    """A port another socket listens on is an OSError naming the endpoint; a free one passes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=rf"endpoint 127.0.0.1:{port}: port {port} is already in use"):
            check_port_free(f"127.0.0.1:{port}")
    check_port_free(f"127.0.0.1:{port}")


def test_rank_logs_read_the_newest_launch_of_a_reused_directory(tmp_path):
    """A log directory that two launches wrote into yields the ranks of the newer one only."""
    import os

    for run, text, age in (("job_a1", "first", 100), ("job_b2", "second", 0)):
        for rank in (0, 1):
            d = tmp_path / run / "attempt_0" / str(rank)
            d.mkdir(parents=True)
            (d / "stderr.log").write_text(f"{text} {rank}")
        os.utime(tmp_path / run, (os.path.getmtime(tmp_path / run) - age,) * 2)
    assert rank_logs(tmp_path) == {0: "second 0", 1: "second 1"}
    assert rank_logs(tmp_path / "nothing") == {}


def test_the_join_watcher_outlives_no_launcher(tmp_path):
    """The watcher's polling child exits by itself once the process that started it is gone, even
    when the store it waits for never appears."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    starter = (
        "import subprocess, sys\n"
        "import os\n"
        "c = subprocess.Popen([sys.executable, '-m', 'harness.launch.rendezvous', '127.0.0.1:9', 'x', '0.2', '600',\n"
        "                      str(os.getpid())])\n"
        "print(c.pid, flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", starter], cwd=root, capture_output=True, text=True, timeout=60
    )
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(child, 9)
    raise AssertionError(f"the watcher child {child} still ran 60 s after its parent exited")
