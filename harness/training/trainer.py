"""The training loop of one rank, built from a `RunPlan` with megatron-core's own pieces.

Model: `MHCTransformerConfig` + `build_gpt_model` (`Float16Module` for bf16), wrapped in
megatron-core's `DistributedDataParallel`. Optimizer: `get_megatron_optimizer` (Adam; torch's
AdamW where Transformer Engine / apex are absent) with `OptimizerParamScheduler` (iteration-based
steps). Step: `get_forward_backward_func()` over the microbatches, which calls
`finalize_model_grads` (DP all-reduce, embedding / SP grads), then `optimizer.step()` (grad norm,
clipping, num-zeros). Loss: Megatron's per-token loss (sum over unmasked tokens, reported as
`[sum, count]`, summed over microbatches and all-reduced over DP).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.training.checkpoint import load_checkpoint, save_checkpoint
from harness.training.data import build_train_dataset, make_tokenizer, microbatches
from harness.training.metrics import StepRecord, memory_metrics, progress_line
from harness.training.model_args import TrainArgs
from harness.training.recipe import RunPlan

__all__ = ["Trainer", "padded_vocab_size"]


def padded_vocab_size(vocab: int, args: TrainArgs) -> int:
    """Megatron's `_vocab_size_with_padding`: up to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab / multiple) * multiple)


def _seed(seed: int) -> None:
    """Megatron's `_set_random_seed`: seed + 100 * pp_rank for python, numpy, torch and the TP tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _config(a: TrainArgs, backend: str, tree_flavor: str | None = None) -> Any:
    """Our `MHCTransformerConfig`, or with `tree_flavor` the tree's own `TransformerConfig` (mHC fields under
    that branch's names: `harness.upstream.tree_model.tree_config`)."""
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if a.bf16 else torch.float32
    common = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_size,
        init_method_std=a.init_method_std,
        hidden_dropout=a.hidden_dropout,
        attention_dropout=a.attention_dropout,
        normalization=a.normalization,
        attention_softmax_in_fp32=a.attention_softmax_in_fp32,
        attention_backend=AttnBackend[a.attention_backend],
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=a.bf16,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        sequence_parallel=a.sequence_parallel,
        recompute_granularity=a.recompute_granularity,
        recompute_modules=list(a.recompute_modules) if a.recompute_modules else None,
        recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers,
        deterministic_mode=a.deterministic_mode,
        gradient_accumulation_fusion=False,
        mhc_sinkhorn_iterations=a.mhc_sinkhorn_iterations,
        mhc_init_gating_factor=a.mhc_init_gating_factor,
        deallocate_pipeline_outputs=False,
        add_bias_linear=not a.disable_bias_linear,
        **_moe_and_mtp(a),
        # gloo matches messages between a pair of ranks first-in-first-out; batched P2P posts sends and
        # receives in one fixed order, which gloo cannot match for PP = 2 (see suites/pp/pp_worker.py).
        batch_p2p_comm=backend == "nccl",
    )
    if tree_flavor is not None:
        from harness.upstream.tree_model import tree_config

        if not a.enable_mhc_connections:
            raise ValueError(
                f"a Megatron-LM tree is checked on mHC recipes; this one has mHC off ({tree_flavor})"
            )
        return tree_config(tree_flavor, n=a.mhc_num_residual_streams, **common)

    from mhc_core.megatron.config import MHCTransformerConfig

    return MHCTransformerConfig(
        **common,
        enable_mhc_connections=a.enable_mhc_connections,
        mhc_num_residual_streams=a.mhc_num_residual_streams,
        mhc_variant=a.mhc_variant,
        mhc_h_res_constraint=a.mhc_h_res_constraint,
        use_fused_mhc=a.use_fused_mhc,
        mhc_learned_contraction=a.mhc_learned_contraction,
        mhc_recompute_layer_num=a.mhc_recompute_layer_num,
        mhc_single_pass=a.mhc_single_pass,
        mhc_norm_eps_inside_sqrt=a.mhc_norm_eps_inside_sqrt,
        mhc_fp32_coefficients=a.mhc_fp32_coefficients,
        mhc_norm_eps=a.mhc_norm_eps,
    )


UNSUPPORTED = {
    "cuda_graph_impl": (
        "none",
        "CUDA graph capture (upstream's training loop drives it; this runner does not)",
    ),
    "num_layers_per_virtual_pipeline_stage": (
        None,
        "interleaved pipeline schedules (this runner trains one model "
        "chunk per rank; the pp suite runs them)",
    ),
    "overlap_moe_expert_parallel_comm": (
        False,
        "the MoE a2a-overlap schedule (refused with mHC: docs/megatron.md)",
    ),
}
"""Flags of upstream's GPU recipes this runner refuses, with why (their goldens are committed as data)."""


def _refuse_unsupported(a: TrainArgs) -> None:
    """`NotImplementedError` naming each flag of `UNSUPPORTED` that is set, and each refused upstream-only flag
    (`harness.training.upstream_flags`)."""
    from harness.training.model_args import flag_of
    from harness.training.upstream_flags import refused

    bad = [
        f"{flag_of(name)}={getattr(a, name)!r}: {why}"
        for name, (off, why) in UNSUPPORTED.items()
        if getattr(a, name) != off
    ] + refused(dict(a.upstream))
    if bad:
        raise NotImplementedError("this runner does not train with " + "; ".join(bad))


def _moe_and_mtp(a: TrainArgs) -> dict[str, Any]:
    """Config keywords of the MoE and MTP flags (none for a dense model without MTP, so its config is unchanged)."""
    out: dict[str, Any] = {}
    if a.num_experts is not None:
        out.update(
            num_moe_experts=a.num_experts,
            moe_router_topk=a.moe_router_topk,
            moe_ffn_hidden_size=a.moe_ffn_hidden_size or a.ffn_size,
            moe_token_dispatcher_type=a.moe_token_dispatcher_type,
            moe_aux_loss_coeff=a.moe_aux_loss_coeff,
            moe_router_load_balancing_type=a.moe_router_load_balancing_type,
            moe_grouped_gemm=a.moe_grouped_gemm,
            moe_router_dtype=a.moe_router_dtype,
            expert_model_parallel_size=a.expert_model_parallel_size,
            expert_tensor_parallel_size=a.expert_tensor_parallel_size,
        )
    if a.mtp_num_layers is not None:
        out.update(mtp_num_layers=a.mtp_num_layers, mtp_loss_scaling_factor=a.mtp_loss_scaling_factor)
    if a.hybrid_layer_pattern is not None and a.pipeline_model_parallel_size > 1:
        from mhc_core.megatron.hybrid import hybrid_layout  # the layer numbers follow the pattern's stages

        out["pipeline_model_parallel_layout"] = hybrid_layout(a.hybrid_layer_pattern)
    return out


def _mtp_metrics(num_microbatches: int) -> dict[str, float]:
    """`{"mtp_<k> loss": ...}` of this step, as megatron's training loop logs it (`track_mtp_metrics`): each depth's
    tracked sum of micro-batch means over `num_microbatches`, averaged over data parallel; the tracker is zeroed."""
    from megatron.core import parallel_state as ps

    from mhc_core.megatron.mtp import tracked_mtp_losses

    values = tracked_mtp_losses()
    if values is None:
        return {}
    total = values.detach().clone()
    values.zero_()
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    total /= ps.get_data_parallel_world_size(with_context_parallel=True) * num_microbatches
    return {f"mtp_{k + 1} loss": float(v) for k, v in enumerate(total)}


def _moe_metrics(a: TrainArgs, step: int, num_microbatches: int) -> dict[str, float]:
    """The routers' tracked losses of this step (`load_balancing_loss`, ...) as megatron's training loop logs them
    (`track_moe_metrics`: summed over the pipeline stages, averaged over data parallel, over `num_microbatches`,
    the mean over the MoE layers); the tracker is cleared. Every rank calls it (its reductions span PP and DP)."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    totals: dict[str, torch.Tensor] = {}
    track_moe_metrics(
        loss_scale=1.0 / num_microbatches,
        iteration=step,
        total_loss_dict=totals,
        num_layers=a.num_layers,
        mtp_num_layers=a.mtp_num_layers,
    )
    return {name: float(value) for name, value in totals.items()}


def _without_stage(sizes: dict[str, Any]) -> dict[str, Any]:
    """The model keywords without `pre_process` / `post_process`, which the tree's chunk builders set per stage."""
    return {k: v for k, v in sizes.items() if k not in ("pre_process", "post_process")}


def retention_checks(train_iters: int) -> set[int]:
    """The steps after which `RetentionCheck` scans, besides a launch's first (its inventory): the last, where
    what every step keeps (the last step's) and what accumulates (all of them) are alive; two scans a launch."""
    return {train_iters}


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's `pretrain_gpt.loss_func`: (sum of unmasked token losses, token count, report)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


class Trainer:
    """Model chunks, optimizer, scheduler and data of one rank; `train` runs the steps."""

    def __init__(
        self, plan: RunPlan, *, data_cache: Path, tree_flavor: str | None = None, init: Path | None = None
    ):
        """`tree_flavor` (`main` / `dev`): the model is the Megatron-LM tree's own GPT (the tree is the
        imported `megatron`); `init`: a full state dict (`harness.training.model_state`) to start from."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        from mhc_core.megatron.distrib_optimizer import align_param_group_index_map
        from mhc_core.megatron.gpt import build_gpt_model

        self.plan, a = plan, plan.args
        self.tree_flavor = tree_flavor
        _refuse_unsupported(a)
        _seed(a.seed)
        self.config = _config(a, plan.backend, tree_flavor)
        self.holds_loss = ps.is_pipeline_last_stage()
        sizes = dict(
            vocab_size=padded_vocab_size(make_tokenizer(a).vocab_size, a),
            max_sequence_length=a.max_position_embeddings or a.seq_length,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=self.holds_loss,
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
            position_embedding_type=a.position_embedding_type,
        )
        if a.hybrid_layer_pattern is not None:
            model = self._hybrid_model(a, sizes, tree_flavor)
        elif tree_flavor is not None:
            from harness.upstream.tree_model import tree_chunks

            model = tree_chunks(tree_flavor, self.config, vpp=None, **_without_stage(sizes))[0]
        else:
            model = build_gpt_model(
                self.config, spec="te" if a.transformer_impl == "transformer_engine" else "local", **sizes
            )
        if init is not None:
            from harness.training.model_state import load_full_state

            load_full_state(
                [model],
                torch.load(init),
                source=f"--init {init}",
                tp_rank=ps.get_tensor_model_parallel_rank(),
                tp_size=a.tensor_model_parallel_size,
            )
        self.model = model
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if a.bf16:
            model = Float16Module(self.config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=a.use_distributed_optimizer,
        )
        self.chunks = [DistributedDataParallel(self.config, ddp_config, model)]
        for chunk in self.chunks:
            chunk.broadcast_params()
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=a.lr,
                min_lr=a.min_lr,
                weight_decay=a.weight_decay,
                adam_beta1=a.adam_beta1,
                adam_beta2=a.adam_beta2,
                adam_eps=a.adam_eps,
                clip_grad=a.clip_grad,
                bf16=a.bf16,
                use_distributed_optimizer=a.use_distributed_optimizer,
                params_dtype=self.config.params_dtype,
                log_num_zeros_in_grad=a.log_num_zeros_in_grad,
            ),
            self.chunks,
        )
        # megatron-core's distributed optimizer misplaces fp32-kept parameters in its checkpoint map (module doc).
        align_param_group_index_map(self.optimizer)
        decay = a.lr_decay_iters or a.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=a.lr,
            min_lr=a.min_lr,
            lr_warmup_steps=a.warmup_iters(),
            lr_decay_steps=decay,
            lr_decay_style=a.lr_decay_style,
            start_wd=a.weight_decay,
            end_wd=a.weight_decay,
            wd_incr_steps=a.train_iters,
            wd_incr_style="constant",
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.chunks[0].no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.dataset = build_train_dataset(
            a, num_samples=a.train_iters * a.global_batch_size, cache_dir=data_cache
        )
        from harness.training.retention import MOE_FULL_RECOMPUTE, RetentionCheck

        moe_full_recompute = a.num_experts is not None and a.recompute_granularity == "full"
        self.retention = RetentionCheck(
            self.chunks,
            self.optimizer,
            checks=retention_checks(a.train_iters),
            roots={"<Trainer>": self},
            outside_python=MOE_FULL_RECOMPUTE if moe_full_recompute else None,
        )
        """What steps leave alive (`harness.training.retention`): the launch's first step is the inventory."""
        self.monitor = None
        if a.enable_mhc_connections:  # every step, 64 tokens: the stability curve (a tree's modules too)
            from mhc_core.monitor import MonitorConfig, StabilityMonitor

            self.monitor = StabilityMonitor(self.chunks, MonitorConfig(every=1, tokens=64))

    def _hybrid_model(self, a: TrainArgs, sizes: dict[str, Any], tree_flavor: str | None) -> Any:
        """The hybrid stack of `--hybrid-layer-pattern`: ours (`mhc_core.megatron.hybrid`), or the tree's own
        `HybridModel` (`harness.upstream.tree_model.hybrid_chunks`)."""
        from megatron.core import parallel_state as ps

        pattern = a.hybrid_layer_pattern
        assert pattern is not None
        if tree_flavor is not None:
            from harness.upstream.tree_model import hybrid_chunks

            return hybrid_chunks(self.config, pattern, vpp=None, **_without_stage(sizes))[0]
        from mhc_core.megatron.gpt import MHCGPTModel
        from mhc_core.megatron.hybrid import hybrid_block_spec, hybrid_mtp_block_spec

        spec = hybrid_block_spec(self.config, pattern, stage=ps.get_pipeline_model_parallel_rank())
        mtp = hybrid_mtp_block_spec(
            self.config, pattern
        )  # the pattern's MTP depths where this stage holds them
        return MHCGPTModel(self.config, spec, **sizes, **({"mtp_block_spec": mtp} if mtp is not None else {}))

    def load(self, root: Path) -> int:
        """Resume from the checkpoint the tracker in `root` names; returns its iteration."""
        return load_checkpoint(root, self.chunks, self.optimizer, self.scheduler)

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        if torch.cuda.is_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        output = model(
            batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
        return output, partial(_loss_func, batch["loss_mask"])

    def step(self, step: int) -> StepRecord:
        """One optimizer step over the global batch of `step` (1-based)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        a, plan = self.plan.args, self.plan
        start = time.perf_counter()
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        data = microbatches(
            self.dataset,
            step=step,
            args=a,
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=plan.data_parallel_size,
            num_microbatches=plan.num_microbatches,
        )
        with self.monitor.sampling(step) if self.monitor else contextlib.nullcontext():
            reports = get_forward_backward_func()(
                forward_step_func=self._forward_step,
                data_iterator=data,
                model=self.chunks[0],
                num_microbatches=plan.num_microbatches,
                seq_length=a.seq_length,
                micro_batch_size=a.micro_batch_size,
                forward_only=False,
            )
        stability = {}
        if self.monitor:
            rep = self.monitor.report(step, group=ps.get_pipeline_model_parallel_group())
            stability = rep.metrics() if rep else {}
        ok, grad_norm, num_zeros = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        loss, extra = float("nan"), {}
        moe = _moe_metrics(a, step, plan.num_microbatches) if a.num_experts is not None else {}
        if self.holds_loss:
            total = torch.vstack([r["lm loss"].view(-1) for r in reports]).sum(dim=0)
            dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
            loss = float(total[0] / total[1])
            extra = {**_mtp_metrics(plan.num_microbatches), **moe}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return StepRecord(
            step=step,
            loss=loss,
            grad_norm=None if grad_norm is None else float(grad_norm),
            num_zeros=None if num_zeros is None else float(num_zeros),
            seconds=time.perf_counter() - start,
            learning_rate=self.optimizer.param_groups[0]["lr"],
            memory=memory_metrics(),
            stability=stability,
            extra=extra,
        )

    def refuse_unsavable(self) -> None:
        """`NotImplementedError` naming why this run's optimizer cannot be checkpointed by megatron-core 0.16.1 on
        this machine (checked before the first step of a run that saves, so no step is wasted)."""
        from mhc_core.precision import is_kept_in_fp32

        a = self.plan.args
        if (
            a.bf16
            and not a.use_distributed_optimizer
            and any(is_kept_in_fp32(p) for p in self.model.parameters())
        ):
            raise NotImplementedError(
                "this run cannot save checkpoints with megatron-core: --bf16 with parameters kept fp32 (the mHC "
                "parameters of dev's numerics) and without --use-distributed-optimizer: the bf16 optimizer's "
                "sharded_state_dict maps only its bf16 parameters and fails on the fp32 ones (upstream trains "
                "these with the distributed optimizer, which checkpoints them)"
            )

    def train(self, *, start: int = 0, save: Path | None = None) -> list[StepRecord]:
        """Steps start+1 .. train_iters; saves every --save-interval steps into `save` (when given)."""
        a = self.plan.args
        if save is not None and a.save_interval:
            self.refuse_unsavable()
        last_rank = dist.get_rank() == dist.get_world_size() - 1
        records = []
        for step in range(start + 1, a.train_iters + 1):
            rec = self.step(step)
            records.append(rec)
            self.retention.after_step(step)
            # A tree's retention is the tree's finding (its report), not an error.
            if self.tree_flavor is None:
                self.retention.raise_if_retained()
            if self.holds_loss and last_rank:
                print(progress_line(rec, a.train_iters), flush=True)
            if save is not None and a.save_interval and step % a.save_interval == 0:
                save_checkpoint(
                    save,
                    step,
                    self.chunks,
                    self.optimizer,
                    self.scheduler,
                    fully_parallel=a.ckpt_fully_parallel_save,
                )
        return records
