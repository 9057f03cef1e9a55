"""A functional case across nodes, in three steps a batch script runs (`ci/slurm/functional.sbatch`).

    python -m harness.launch.multinode plan CASE --out DIR --nodes N [--hw KEY]
    python -m harness.launch.multinode node --out DIR --endpoint HOST:PORT --run-id ID --node-rank R
    python -m harness.launch.multinode check --out DIR [--golden-dir golden] [--results-dir DIR]

`plan` (once, before the nodes start) resolves the recipe for the hardware key, spreads its ranks
over N nodes (`recipe.as_nodes`: the same world, TP, PP, DP and batches as the recipe's own entry,
so the same golden file), builds the dataset and writes `DIR/plan.json`. `node` (once per node, e.g.
one `srun` task each) starts this node's torchrun agent, which joins the others through a c10d
rendezvous at the endpoint (node rank 0 serves the store); the rank that holds the loss writes
`DIR/metrics.json`, so DIR must be a directory every node sees. `check` (once, on one node) compares
those metrics with `golden/<hw>/functional/<case>.json` under the recipe's checks, as the
functional suite does, and prints the outcome; it never writes a golden file.

Exit codes: 0 done / passed; 1 the run or the golden check failed (the message names the node,
rank or metric); 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from harness.launch.rendezvous import Rendezvous, RendezvousBackend
from harness.launch.runs import REPO_ROOT, plan_case, prepare_out_dir, run_node
from harness.launch.torchrun import LaunchError
from harness.training.recipe import RECIPE_DIR, RunPlan, as_nodes, load_plan, load_recipe

__all__ = ["check_run", "main", "write_plan"]


def write_plan(case: str, hw: str, out: Path, *, nodes: int | None = None) -> RunPlan:
    """Resolve `case` on `hw` over `nodes` nodes (default: the recipe's `nnodes`), write `out/plan.json`."""
    plan = plan_case(case, hw, data_dir=out / "data")
    if nodes is not None and nodes != plan.nnodes:
        plan = as_nodes(plan, nodes)
    prepare_out_dir(plan, out, out / "data")
    return plan


def check_run(out: Path, *, golden_dir: Path, results_dir: Path | None = None):
    """Compare the metrics a multi-node run left in `out` with its golden file; a `CaseOutcome`.
    `ValueError` naming the file when the plan or the metrics are missing or unreadable."""
    from harness.golden.case_check import GoldenSettings, check_case
    from harness.golden.fingerprint import fingerprint_from_json
    from harness.golden.hardware import detect_hardware
    from harness.training.metrics import read_metrics

    plan = _load_plan(out)
    for name in ("metrics.json", "fingerprint.json"):
        if not (out / name).is_file():
            raise ValueError(f"{out / name}: missing; the run did not finish (its logs: {out / 'logs'})")
    try:
        metrics = read_metrics(out / "metrics.json")
        fingerprint = fingerprint_from_json(
            json.loads((out / "fingerprint.json").read_text(encoding="utf-8")),
            source=str(out / "fingerprint.json"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{out}: unreadable run output: {exc}") from None
    recipe = load_recipe(RECIPE_DIR / f"{plan.case}.yaml")
    settings = GoldenSettings(
        golden_dir=golden_dir, hw=detect_hardware(override=plan.hw), results_dir=results_dir
    )
    return check_case(
        settings,
        suite="functional",
        case=plan.case,
        metrics=metrics,
        checks=recipe.checks(plan.hw),
        fingerprint=fingerprint,
    )


def _load_plan(out: Path) -> RunPlan:
    path = out / "plan.json"
    try:
        return load_plan(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; run `multinode plan` first") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a run plan: {exc}") from None


def _terminate(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.launch.multinode", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="resolve a recipe over N nodes and write DIR/plan.json")
    pl.add_argument("case")
    pl.add_argument("--out", type=Path, required=True, help="a directory every node sees")
    pl.add_argument("--nodes", type=int, default=None, help="node count (default: the recipe's nnodes)")
    pl.add_argument("--hw", default=None, help="hardware key (default: $MHC_HW, else detection)")
    nd = sub.add_parser("node", help="run this node's torchrun agent")
    nd.add_argument("--out", type=Path, required=True)
    nd.add_argument("--endpoint", required=True, help="host:port of the rendezvous store (the first node)")
    nd.add_argument("--run-id", required=True, help="the same on every node (Slurm: the job id)")
    nd.add_argument(
        "--node-rank", type=int, required=True, help="0 serves the rendezvous store (Slurm: SLURM_NODEID)"
    )
    nd.add_argument("--backend", choices=[b.value for b in RendezvousBackend], default="c10d")
    nd.add_argument("--join-timeout", type=float, default=600.0, help="seconds to wait for every node")
    nd.add_argument(
        "--timeout", type=float, default=None, help="seconds the run may take (default: the recipe's)"
    )
    ck = sub.add_parser("check", help="compare DIR/metrics.json with the golden file")
    ck.add_argument("--out", type=Path, required=True)
    ck.add_argument("--golden-dir", type=Path, default=REPO_ROOT / "golden")
    ck.add_argument(
        "--results-dir", type=Path, default=None, help="also write the outcome there (harness layout)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "plan":
            from harness.golden.hardware import detect_hardware

            hw = detect_hardware(override=args.hw).key
            plan = write_plan(args.case, hw, args.out, nodes=args.nodes)
            print(
                f"{args.out / 'plan.json'}: {plan.case} on {hw}, {plan.nnodes} node(s) x {plan.nproc} ranks, "
                f"DP{plan.data_parallel_size}"
            )
            return 0
        if args.command == "node":
            # srun (and a batch system's cancel) stops a task with SIGTERM: unwind, so that the launcher
            # kills this node's agent and ranks on the way out instead of leaving them behind.
            signal.signal(signal.SIGTERM, _terminate)
            plan = _load_plan(args.out)
            rdzv = Rendezvous(
                nnodes=plan.nnodes,
                endpoint=args.endpoint,
                run_id=args.run_id,
                backend=RendezvousBackend(args.backend),
                node_rank=args.node_rank,
                is_host=args.node_rank == 0,
                join_timeout=args.join_timeout,
            )
            run_node(plan, args.out, rdzv, data_dir=args.out / "data", timeout=args.timeout)
            return 0
        outcome = check_run(args.out, golden_dir=args.golden_dir, results_dir=args.results_dir)
        print(
            f"functional/{outcome.case} on {outcome.hw}: {outcome.status}"
            + (f" ({outcome.lane}; {outcome.lane_reason})" if outcome.lane else "")
        )
        if outcome.message:
            print(outcome.message)
        return 1 if outcome.failed else 0
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
