"""Two "nodes" on one box: torchrun agents joined by a c10d rendezvous on 127.0.0.1, as on a cluster.

The run is `ci/slurm/functional.sbatch` itself (`multinode plan`, one `multinode node` per node,
`multinode check` once), with stand-ins for Slurm's `srun` and `scontrol` (`slurm_standin/`: one
task per node on this machine, every host the loopback address); the failures go through the same
`multinode` commands and through `harness.launch.nodes` (what `run_plan` uses for a plan of several
nodes).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.launch.nodes import NodesLaunchError, free_endpoint, launch_nodes
from harness.launch.runs import CRASH_RANK_ENV_VAR, REPO_ROOT, WORKER, run_plan
from harness.launch.torchrun import live_pids
from harness.training.metrics import GRAD_NORM, LM_LOSS, NUM_ZEROS, read_metrics
from harness.training.recipe import as_nodes
from suites.functional.session import MULTINODE_TIMES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = "gpt_tp2_pp2_mhc"
"""TP2 x PP2 on 4 ranks: as two nodes of two ranks, each stage's TP pair sits on one node."""
NODES = 2


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != CRASH_RANK_ENV_VAR}
    return subprocess.run(
        [sys.executable, "-m", "harness.launch.multinode", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


SBATCH = REPO_ROOT / "ci" / "slurm" / "functional.sbatch"
STANDIN = Path(__file__).with_name("slurm_standin")


def _sbatch(
    case: str, out_root: Path, *, hw: str, port: int, job_id: str, timeout: float
) -> subprocess.CompletedProcess:
    """The batch script as Slurm would start it on the first node of a 2-node allocation."""
    env = {k: v for k, v in os.environ.items() if k != CRASH_RANK_ENV_VAR}
    env.update(
        PATH=f"{STANDIN}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}",
        PYTHON=sys.executable,
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NUM_NODES=str(NODES),
        SLURM_JOB_NODELIST="node[0-1]",
        OUT=str(out_root),
        PORT=str(port),
        HW=hw,
        JOIN_TIMEOUT="120",
    )
    return subprocess.run(
        ["bash", str(SBATCH), case],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _golden_digest(hw: str) -> dict[str, str]:
    folder = REPO_ROOT / "golden" / hw / "functional"
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob(f"{CASE}*"))
        if p.is_file()
    }


@pytest.fixture
def planned(tmp_path, functional_runs) -> Path:
    """`multinode plan` of the case over two nodes, in a fresh directory."""
    reason = functional_runs.skip_reason(CASE)
    if reason:
        pytest.skip(reason)
    out = tmp_path / "job"
    proc = _cli("plan", CASE, "--out", str(out), "--nodes", str(NODES), "--hw", functional_runs.hw)
    assert proc.returncode == 0, proc.stderr
    assert f"{NODES} node(s) x 2 ranks, DP1" in proc.stdout
    return out


def test_two_agents_reproduce_the_one_node_run_bit_for_bit(functional_runs, tmp_path, request):
    """The Slurm script on two "nodes" (two agents x two ranks) gives the one-node run's lm loss, grad
    norm, num-zeros and stability metrics bit for bit, and its golden check passes without writing a
    golden file."""
    one = functional_runs.deterministic_run(CASE)
    before = _golden_digest(functional_runs.hw)
    port = int(free_endpoint().rpartition(":")[2])
    start = time.monotonic()
    proc = _sbatch(
        CASE, tmp_path, hw=functional_runs.hw, port=port, job_id="4242", timeout=one.plan.timeout + 120
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = tmp_path / f"{CASE}-4242"
    assert f"{NODES} node(s) x 2 ranks, DP1" in proc.stdout
    assert "node0 joins 4242 at 127.0.0.1:" in proc.stdout and "node1 joins 4242 at 127.0.0.1:" in proc.stdout
    two = read_metrics(out / "metrics.json")
    for name in (LM_LOSS, GRAD_NORM, NUM_ZEROS, "mhc-amax-gain-fwd", "mhc-sum-dev-max"):
        diff = {s: (two[name].get(s), v) for s, v in one.metrics[name].items() if two[name].get(s) != v}
        assert not diff, f"{name}: steps where two agents differ from one node (two, one): {diff}"
    assert f"functional/{CASE} on {functional_runs.hw}: pass" in proc.stdout, proc.stdout[-3000:]
    assert (out / "results").is_dir()
    assert _golden_digest(functional_runs.hw) == before
    assert not live_pids("worker.py", str(out))
    request.config.stash.setdefault(MULTINODE_TIMES, {})[CASE] = (seconds, one.seconds)


def test_a_rank_that_crashes_on_the_second_node_ends_the_job(functional_runs, tmp_path):
    """Rank 3 (the second node's second rank) raises: both agents exit, and the error names the node and
    the rank with its stderr; nothing is left running, no metrics and no golden file are written."""
    reason = functional_runs.skip_reason(CASE)
    if reason:
        pytest.skip(reason)
    plan = as_nodes(functional_runs.plan(CASE), NODES)
    before = _golden_digest(functional_runs.hw)
    out = tmp_path / "crash"
    start = time.monotonic()
    with pytest.raises(NodesLaunchError) as err:
        run_plan(plan, out, data_dir=functional_runs.data_dir, env={CRASH_RANK_ENV_VAR: "3"}, timeout=240)
    seconds = time.monotonic() - start
    message = str(err.value)
    node = err.value.failed_node
    assert re.search(
        rf"on 2 nodes: node{node} failed first \(agent exit code 1\); stopped node{1 - node}", message
    ), message
    # The agent that held rank 3 is the rendezvous's second node (group rank 1: global ranks 2 and 3).
    assert (
        f"node{node} rank 3 (local rank 1, group rank 1) exited with code 1, the first observed failure"
        in message
    )
    assert "rank 3 of 4: crash planted by $MHC_FUNCTIONAL_TEST_CRASH_RANK" in message
    assert all(n.returncode is not None for n in err.value.nodes.nodes)
    assert not live_pids("worker.py", str(out)) and not (out / "metrics.json").exists()
    assert _golden_digest(functional_runs.hw) == before
    assert seconds < 120, f"the job took {seconds:.0f} s to end after the crash"


def test_a_node_that_never_joins_times_out_naming_the_count(planned):
    """The host node alone: the rendezvous times out after its join timeout, saying 1 of 2 nodes joined."""
    start = time.monotonic()
    proc = _cli(
        "node",
        "--out",
        str(planned),
        "--endpoint",
        free_endpoint(),
        "--run-id",
        "alone",
        "--node-rank",
        "0",
        "--join-timeout",
        "4",
        timeout=120,
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(
        r"rendezvous alone at 127\.0\.0\.1:\d+ timed out after 4 s: 1 of 2 nodes joined", proc.stderr
    ), proc.stderr[-3000:]
    assert (
        seconds < 60 and not live_pids("worker.py", str(planned)) and not (planned / "metrics.json").exists()
    )


def test_a_node_whose_host_never_starts_names_the_store(planned):
    """Node 1 alone: its agent gives up on the host's store after the join timeout, 0 of 2 joined."""
    endpoint = free_endpoint()
    proc = _cli(
        "node",
        "--out",
        str(planned),
        "--endpoint",
        endpoint,
        "--run-id",
        "hostless",
        "--node-rank",
        "1",
        "--join-timeout",
        "3",
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"rendezvous hostless: the store at {endpoint} did not answer within 3 s" in proc.stderr
    assert "0 of 2 nodes joined" in proc.stderr and not live_pids("worker.py", str(planned))


def test_a_taken_port_is_an_error_naming_the_endpoint(planned, tmp_path):
    """The host node's endpoint port is taken: `multinode node` and `launch_nodes` refuse, naming it,
    before any agent starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        proc = _cli(
            "node",
            "--out",
            str(planned),
            "--endpoint",
            endpoint,
            "--run-id",
            "taken",
            "--node-rank",
            "0",
            timeout=60,
        )
        assert proc.returncode == 2 and f"rendezvous endpoint {endpoint}: port" in proc.stderr, proc.stderr
        assert "is already in use" in proc.stderr
        with pytest.raises(OSError, match=f"rendezvous endpoint {endpoint}: port .* is already in use"):
            launch_nodes(
                WORKER, [], nnodes=2, nproc=2, timeout=30, log_dir=tmp_path / "logs", endpoint=endpoint
            )
    assert not (tmp_path / "logs").exists() and not (planned / "logs").exists()


def test_check_without_a_finished_run_names_the_missing_file(planned, tmp_path):
    """`multinode check` of a run that never finished, or of a directory without a plan, exits 2 naming the file."""
    proc = _cli("check", "--out", str(planned))
    assert (
        proc.returncode == 2 and f"{planned / 'metrics.json'}: missing; the run did not finish" in proc.stderr
    )
    proc = _cli("check", "--out", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "plan.json: missing; run `multinode plan` first" in proc.stderr
