"""Save / load a training state with megatron-core's distributed checkpointing.

Layout as Megatron-LM's trainer writes it: `<dir>/iter_0000010/` (torch_dist format:
`*.distcp`, `common.pt`, `metadata.json`) and `<dir>/latest_checkpointed_iteration.txt`.
The state: the model's `sharded_state_dict(metadata=...)`, the optimizer's `sharded_state_dict(model_sd,
metadata=...)` with the content metadata Megatron-LM's trainer passes (`_metadata`: GPT with MTP on a stage
without the embedding ties the embedding copy over the data-parallel group it names),
the lr scheduler and the iteration (common, written by rank 0), and every rank's RNG states as
a `ShardedObject` over (PP, TP) with the DP rank as replica id (as `megatron.training` does).
The distributed optimizer's parameter state is `dp_reshardable` (Megatron-LM's default without
`--dist-ckpt-optim-fully-reshardable`).

Where Transformer Engine and apex are absent, megatron-core steps torch's AdamW, which keeps the
step count in each parameter's state; megatron-core's distributed optimizer (0.16.1, 0.19.2) does
not load that path as it saves it, and two mends here make the resume bitwise:
- before the loading template is built, an optimizer without state (a fresh launch) gets AdamW's
  zero state (`DistributedOptimizer.state_dict` reads the step from the state and asserts one value);
- after loading, each parameter's step is the saved one and a tensor of its own: the
  `dp_reshardable` parameter state carries the step as a local, unsaved object (it loads as the
  template's zero), and `load_state_dict` gives every parameter one shared step tensor, which the
  single-tensor AdamW then advances once per parameter.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["TRACKER", "iteration_dir", "load_checkpoint", "rewind_tracker", "save_checkpoint"]

_ADAM = (torch.optim.Adam, torch.optim.AdamW)

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _rng_state() -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        [state],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _set_rng_state(states: list[dict[str, Any]]) -> None:
    from megatron.core import tensor_parallel

    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state["cuda_rng_state"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _metadata() -> dict[str, Any]:
    """The sharded-state-dict content metadata `megatron.training.checkpointing` builds
    (`_build_sharded_state_dict_metadata`): plain local shards, chained optimizers without a prefix, the
    data-parallel (with context-parallel) group, and the distributed optimizer's `dp_reshardable` format (the
    other optimizers ignore it)."""
    from megatron.core import parallel_state as ps

    return {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
        "distrib_optim_sharding_type": "dp_reshardable",
    }


def _torch_adam_parts(optimizer: Any) -> list[Any]:
    """The distributed-optimizer parts of `optimizer` that step torch's Adam / AdamW (no TE / apex)."""
    from mhc_core.megatron.distrib_optimizer import optimizer_parts

    return [
        part
        for part in optimizer_parts(optimizer)
        if hasattr(part, "model_param_group_index_map") and isinstance(part.optimizer, _ADAM)
    ]


def _seed_adam_state(optimizer: Any) -> None:
    """AdamW's zero state (step 0, zero moments) for every main parameter of a part that has no state yet."""
    for part in _torch_adam_parts(optimizer):
        inner = part.optimizer
        if len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def _saved_steps(state: Any) -> set[Any]:
    """The `step` of every parameter group in a loaded optimizer state (nested per chained part)."""
    steps: set[Any] = set()
    if isinstance(state, dict):
        steps.update(g["step"] for g in state.get("param_groups", []) if "step" in g)
        for value in state.values():
            steps |= _saved_steps(value)
    return steps


def _restore_adam_steps(optimizer: Any, loaded: Any, source: Path) -> None:
    """Each main parameter's AdamW step = the saved step, in a tensor of its own."""
    parts = _torch_adam_parts(optimizer)
    if not parts:
        return
    steps = _saved_steps(loaded)
    if len(steps) != 1:
        raise ValueError(
            f"{source}: the optimizer's parameter groups hold steps {sorted(steps)}, expected one"
        )
    (step,) = steps
    for part in parts:
        for state in part.optimizer.state.values():
            state["step"] = torch.tensor(float(step))


def _state(
    chunks: list[Any], optimizer: Any, scheduler: Any, iteration: int, *, is_loading: bool
) -> dict[str, Any]:
    model_sd: dict[str, Any] = {}
    state: dict[str, Any] = {}
    metadata = _metadata()
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        state[key] = chunk.module.sharded_state_dict(metadata=metadata)
        model_sd.update(state[key])
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state["rng_state"] = _rng_state()
    return state


def _strategy(fully_parallel: bool) -> Any:
    if not fully_parallel:
        return None
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        ps.get_data_parallel_group(with_context_parallel=True),
    )


def save_checkpoint(
    root: Path,
    iteration: int,
    chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    *,
    fully_parallel: bool = False,
) -> Path:
    """Save the training state after `iteration` into `<root>/iter_<iteration>` and point the tracker at it."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    target = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(
        _state(chunks, optimizer, scheduler, iteration, is_loading=False),
        str(target),
        sharded_strategy=_strategy(fully_parallel),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / TRACKER).write_text(f"{iteration}\n", encoding="utf-8")
    dist.barrier()
    return target


def load_checkpoint(root: Path, chunks: list[Any], optimizer: Any, scheduler: Any) -> int:
    """Load the iteration the tracker names; returns it. Model, optimizer, scheduler and RNG are restored."""
    from megatron.core import dist_checkpointing

    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(f"no {TRACKER} in {root}: nothing to resume from")
    iteration = int(tracker.read_text(encoding="utf-8").strip())
    source = iteration_dir(root, iteration)
    _seed_adam_state(optimizer)
    template = _state(chunks, optimizer, scheduler, iteration, is_loading=True)
    loaded = dist_checkpointing.load(template, str(source))
    for i, chunk in enumerate(chunks):
        chunk.module.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
    # The distributed optimizer copies into its fp32 shards in place, and those of fp32 parameters are views of
    # the parameters themselves (leaves that require grad).
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"], source)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _set_rng_state(loaded["rng_state"])
    if loaded["iteration"] != iteration:
        raise ValueError(f"{source} holds iteration {loaded['iteration']}, tracker says {iteration}")
    return iteration


def rewind_tracker(root: Path, iteration: int) -> None:
    """Upstream's ckpt-resume step: drop every checkpoint after `iteration`, point the tracker at it."""
    root = Path(root)
    if not iteration_dir(root, iteration).is_dir():
        raise FileNotFoundError(f"{iteration_dir(root, iteration)} does not exist: run 1 did not save it")
    for d in root.glob("iter_*"):
        if int(d.name[5:]) > iteration:
            shutil.rmtree(d)
    (root / TRACKER).write_text(f"{iteration}\n", encoding="utf-8")
