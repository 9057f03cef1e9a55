"""One rank of a functional mini-training (the `torchrun` entry point; gloo on CPU, NCCL on GPU).

Trains the GPT of a resolved recipe (`--plan`, written by `runner.py`) with megatron-core end to
end: `MHCTransformerConfig` + `build_gpt_model`, megatron-core's `DistributedDataParallel`, its
optimizer (`get_megatron_optimizer`, Adam) and `OptimizerParamScheduler`, the forward-backward
schedule of `get_forward_backward_func` with `finalize_model_grads`, the dataset pipeline of
`megatron.core.datasets`, and `megatron.core.dist_checkpointing` for `--save` / `--load`.

The rank that holds the loss (the last one: last pipeline stage) prints one progress line per step
and writes `<out>/metrics.json` (golden schema) and `<out>/fingerprint.json` (the numerics
fingerprint of the process that computed them, `harness.golden.fingerprint`) at the end. Top-level imports stay light: the
torch_dist checkpoint writer spawns a helper process that imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, type=Path, help="run plan JSON (runner.py)")
    p.add_argument("--out", required=True, type=Path, help="metrics.json goes here")
    p.add_argument("--data-cache", required=True, type=Path, help="dataset index cache directory")
    p.add_argument(
        "--save", type=Path, default=None, help="checkpoint root: save every --save-interval steps"
    )
    p.add_argument(
        "--load", type=Path, default=None, help="checkpoint root: resume from its tracker's iteration"
    )
    p.add_argument(
        "--tree-flavor",
        choices=("main", "dev"),
        default=None,
        help="train a Megatron-LM tree's own GPT (the tree is first on PYTHONPATH)",
    )
    p.add_argument(
        "--init", type=Path, default=None, help="full state dict to start from (harness.training.model_state)"
    )
    p.add_argument(
        "--dump-init",
        type=Path,
        default=None,
        help="write the initial full state dict here (rank 0) and stop before the first step",
    )
    p.add_argument(
        "--then-train",
        action="store_true",
        help="with --dump-init: train on after writing it (one launch where dump-then---init takes two)",
    )
    args = p.parse_args(argv)
    if args.then_train and args.dump_init is None:
        p.error("--then-train needs --dump-init")
    return args


def main(argv: list[str] | None = None) -> None:
    cli = parse_args(argv)
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():  # before megatron-core is imported (a CPU rank's start-up)
        from harness.training.deferred_compile import defer_compile

        defer_compile()

    from harness.training.recipe import load_plan

    plan = load_plan(cli.plan)
    a = plan.args
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group(plan.backend)
    if os.environ.get("MHC_FUNCTIONAL_TEST_CRASH_RANK") == str(dist.get_rank()):
        raise RuntimeError(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: crash planted by "
            "$MHC_FUNCTIONAL_TEST_CRASH_RANK (a test of the launcher)"
        )

    from megatron.core import parallel_state as ps

    from harness.training.trainer import Trainer
    from mhc_core.megatron import cpu_support
    from mhc_core.megatron.pipeline import enable_mhc_pipeline

    cpu_support.install()
    if cli.tree_flavor is None:  # a tree's schedules are its own (dev's are n-stream aware)
        enable_mhc_pipeline()
    if a.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        expert_model_parallel_size=a.expert_model_parallel_size,
    )
    try:
        trainer = Trainer(plan, data_cache=cli.data_cache, tree_flavor=cli.tree_flavor, init=cli.init)
        from harness.training.retention import PLANT_ENV_VAR, plant_retention

        if os.environ.get(PLANT_ENV_VAR):
            plant_retention(trainer.model, os.environ[PLANT_ENV_VAR])
        if cli.dump_init is not None:
            from harness.training.model_state import gather_full_state

            full = gather_full_state(
                [trainer.model],
                tp_rank=ps.get_tensor_model_parallel_rank(),
                tp_size=a.tensor_model_parallel_size,
            )
            if full is not None:
                cli.dump_init.parent.mkdir(parents=True, exist_ok=True)
                tmp = cli.dump_init.with_name(f".{cli.dump_init.name}.tmp")
                torch.save(full, tmp)
                os.replace(tmp, cli.dump_init)
            dist.barrier()
            if not cli.then_train:
                return
        start = trainer.load(cli.load) if cli.load else 0
        try:
            records = trainer.train(start=start, save=cli.save)
        finally:
            trainer.retention.write(cli.out / f"retention-rank{dist.get_rank()}.json")
        if trainer.holds_loss and dist.get_rank() == dist.get_world_size() - 1:
            from harness.golden.fingerprint import current_fingerprint
            from harness.training.metrics import write_metrics

            cli.out.mkdir(parents=True, exist_ok=True)
            write_metrics(cli.out / "metrics.json", records)
            (cli.out / "fingerprint.json").write_text(
                json.dumps(current_fingerprint().to_json(), indent=1) + "\n", encoding="utf-8"
            )
        dist.barrier()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
