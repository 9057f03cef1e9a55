"""One rank of a pipeline-parallel mHC GPT training run (launched by `torchrun`; gloo on CPU).

Every case (and the single-process reference) trains the same tiny mHC GPT for `--steps` steps of
`--microbatches` microbatches with plain SGD. `--impl ours` (default) builds it with `mhc_core.megatron`
(`--numerics dev`: the `megatron_dev` variant with the learned block exit, as upstream dev trains);
`--impl tree --flavor main|dev` with a Megatron-LM tree's own config, spec builder, `GPTModel` and
schedules (`harness.upstream.tree_model`; the launcher puts the tree first on `PYTHONPATH`). The reference (PP = TP = 1) also writes the initial
full state dict, which every pipelined rank loads (layers mapped by global layer number, TP shards
sliced), so all runs start from the same weights. Each rank writes `rank<r>.pt` with its
microbatch losses, gradients and post-step weights (keyed by full parameter name, with the TP slice
they hold) and every P2P shape it sent or received.

`--batch FILE` runs several cases one after the other in one launch (FILE: a JSON list of
`{"out": DIR, "args": [flags]}`; the model-parallel state is torn down and rebuilt between cases, the seeds
set again): a launch's start-up (the agent, each rank's imports of torch and megatron-core) is most of a
case's time on a CPU, so the suite runs its cases of one world size together (`suites/pp/batches.py`). A rank
whose case raises writes `error-rank<r>.txt` into that case's directory before the launch fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab=64, seq=16, mbs=2, n=4)
REFUSED = 3
"""Exit code of a `--impl tree` rank whose tree refused the configuration (its message in refusal-rank<r>.txt)."""


def _recompute_kwargs(value: str | None, full: bool = False) -> dict:
    """Config keywords for `--mhc-recompute` and `--full-recompute` (none when unset)."""
    if full:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if value is None:
        return {}
    return {
        "recompute_granularity": "selective",
        "recompute_modules": ["mhc"],
        "mhc_recompute_layer_num": None if value == "chunk" else int(value),
    }


def _moe_kwargs(dispatcher: str) -> dict:
    """Config keywords of `--moe`: every MLP an MoE of 4 local experts, top-2, the router's load-balancing loss on
    (upstream's MoE recipes run without linear biases)."""
    return {
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 64,
        "ffn_hidden_size": 64,
        "add_bias_linear": False,
        "moe_aux_loss_coeff": 1e-2,
        "moe_token_dispatcher_type": dispatcher,
    }


def _aux_losses() -> dict[str, torch.Tensor]:
    """The MoE routers' tracked losses of this step (`{name: [layers]}`, this rank's layers non-zero), then cleared."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    out = {
        name: entry["values"].detach().clone() for name, entry in get_moe_layer_wise_logging_tracker().items()
    }
    clear_aux_losses_tracker()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--embedding-stage", action="store_true", help="account_for_embedding_in_pipeline_split")
    p.add_argument("--loss-stage", action="store_true", help="account_for_loss_in_pipeline_split")
    p.add_argument("--no-mhc", action="store_true")
    p.add_argument("--impl", choices=("ours", "tree"), default="ours", help="whose GPT and schedules run")
    p.add_argument("--flavor", choices=("main", "dev"), default=None, help="--impl tree: the tree's branch")
    p.add_argument(
        "--numerics",
        choices=("main", "dev"),
        default="main",
        help="--impl ours: megatron_main, or megatron_dev with the learned block exit",
    )
    p.add_argument(
        "--single-pass",
        action="store_true",
        help="--impl ours: DeepSeek-V4.1's single-pass form and numerics (deepseek_v41, the model's RMS "
        "epsilon in the mapping)",
    )
    p.add_argument(
        "--handoff",
        choices=("exact", "pipeline_dtype"),
        default="exact",
        help="--single-pass: the H_pre across stage boundaries in its own dtype, or rounded to the "
        "pipeline dtype (upstream DSv41HybridStack's packing)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="megatron-core's bf16 mixed precision: bf16 parameters and activations (Float16Module), a "
        "bf16 pipeline, mHC parameters kept fp32",
    )
    p.add_argument(
        "--mhc-recompute",
        default=None,
        metavar="LAYERS|chunk",
        help='"mhc" in recompute_modules, LAYERS per recompute group or the whole chunk',
    )
    p.add_argument(
        "--full-recompute",
        action="store_true",
        help="full activation recompute, one layer per checkpoint (with --single-pass: the carrier crosses "
        "each checkpoint)",
    )
    p.add_argument(
        "--moe",
        choices=("allgather", "alltoall"),
        default=None,
        help="every MLP an MoE (4 local experts, top-2) with this token dispatcher",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (with --moe): the other ranks of the world are data-parallel, each "
        "taking its share of the step's microbatches",
    )
    p.add_argument(
        "--hybrid",
        default=None,
        metavar="PATTERN",
        help="the hybrid stack of this layer pattern (ours, or the tree's HybridModel (mhc_core.megatron.hybrid: '*' attention, "
        "'-' MLP, 'E' MoE of 4 local experts, '|' a stage boundary, '/' MTP depths after the decoder's "
        "pattern: their count is --mtp)",
    )
    p.add_argument("--layout", default=None, help="pipeline_model_parallel_layout, e.g. 'Et|tt|t|mL'")
    p.add_argument(
        "--mtp",
        type=int,
        default=None,
        metavar="D",
        help="D multi-token prediction depths on the last stage (MTP loss scale 0.1, rope positions)",
    )
    p.add_argument("--init", default=None, help="state dict to start from (written by the reference)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--crash-rank", type=int, default=None, help="test hook: this rank dies mid-run")
    p.add_argument("--hang-rank", type=int, default=None, help="test hook: this rank sleeps forever")
    args = p.parse_args(argv)
    if (
        args.hybrid and "/" in args.hybrid
    ):  # the pattern's MTP depths (dev's unified form) are the run's MTP depths
        args.mtp = args.hybrid.count("/")
    return args


def main(argv: list[str] | None = None) -> None:
    from harness.training.deferred_compile import defer_compile

    defer_compile()  # before megatron-core is imported: its jit_fuser decorations would import Inductor
    argv = sys.argv[1:] if argv is None else argv
    cases = _batch(argv) if "--batch" in argv else [None]
    if torch.cuda.is_available():  # cpu_support would apply nothing and megatron's p2p buffers would be CUDA
        raise SystemExit(
            "pp_worker runs its ranks on the CPU: launch it with CUDA_VISIBLE_DEVICES='' "
            "(suites/pp/launch.py does)"
        )
    dist.init_process_group("gloo")

    from mhc_core.megatron import cpu_support

    cpu_support.install()
    for case in cases:
        args = parse_args(argv if case is None else ["--out", case["out"], *case["args"]])
        try:
            run_case(args)
        except Exception:  # SystemExit (a tree's refusal) has its own file
            (Path(args.out) / f"error-rank{dist.get_rank()}.txt").write_text(
                traceback.format_exc(), encoding="utf-8"
            )
            raise
    dist.destroy_process_group()


def _batch(argv: list[str]) -> list[dict[str, Any]]:
    """The cases of `--out DIR --batch FILE` (DIR: the launch's logs), each `{"out": DIR, "args": [flags]}`."""
    p = argparse.ArgumentParser(prog="pp_worker.py --batch")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", required=True, type=Path)
    cases = json.loads(p.parse_args(argv).batch.read_text(encoding="utf-8"))
    if not isinstance(cases, list) or not all(
        isinstance(c, dict) and {"out", "args"} <= c.keys() for c in cases
    ):
        raise SystemExit(f"{argv}: --batch wants a JSON list of {{'out': DIR, 'args': [flags]}}")
    return cases


def _clear_trackers() -> None:
    """Empty megatron-core's MoE and MTP loss trackers: a case of a batch starts as a fresh process would."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()


def run_case(args: argparse.Namespace) -> None:
    """Train one case on the process group already initialised; writes `rank<r>.pt` into `args.out`."""
    rank = dist.get_rank()

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func, p2p_communication, schedules
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from harness.training.model_state import canonical_name, full_names, load_full_state

    _clear_trackers()
    shapes: list[tuple[str, tuple[int, ...]]] = []
    shape_calls: list[dict] = []
    if args.impl == "tree":
        from harness.upstream.tree_model import record_tensor_shapes

        base = p2p_communication.P2PCommunicator  # the tree's own: its schedules size n-stream buffers
        record_tensor_shapes(schedules, shape_calls)
    else:
        from mhc_core.megatron.pipeline import NStreamP2PCommunicator, enable_mhc_pipeline

        enable_mhc_pipeline()
        base = NStreamP2PCommunicator
    schedules.P2PCommunicator = _recording(base, shapes)

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        expert_model_parallel_size=args.ep,
    )
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)

    m = MODEL
    common = dict(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        bf16=args.bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        sequence_parallel=args.sp,
        account_for_embedding_in_pipeline_split=args.embedding_stage,
        account_for_loss_in_pipeline_split=args.loss_stage,
        **_recompute_kwargs(args.mhc_recompute, args.full_recompute),
        deallocate_pipeline_outputs=False,
        # Unbatched P2P orders sends/receives by rank parity. Batched P2P posts them in one fixed
        # order; gloo matches messages between a pair of ranks first-in-first-out, so with PP = 2
        # under VPP (both neighbours are the same rank) an activation lands in a gradient buffer.
        batch_p2p_comm=False,
        **(_moe_kwargs(args.moe) if args.moe else {}),
        **({"expert_model_parallel_size": args.ep} if args.ep > 1 else {}),
        **({"mtp_num_layers": args.mtp, "mtp_loss_scaling_factor": 0.1} if args.mtp else {}),
        **({"pipeline_model_parallel_layout": args.layout} if args.layout else {}),
    )
    if args.hybrid:
        common.update(_hybrid_kwargs(args.hybrid))
    if args.impl == "tree":
        from harness.upstream.tree_model import tree_chunks, tree_config

        try:
            config = tree_config(args.flavor, n=m["n"], **common)
            model_kwargs = dict(
                vocab_size=m["vocab"],
                max_sequence_length=m["seq"],
                share_embeddings_and_output_weights=False,
                position_embedding_type="rope" if args.mtp else "learned_absolute",
            )
            if args.hybrid:
                from harness.upstream.tree_model import hybrid_chunks

                chunks = hybrid_chunks(config, args.hybrid, vpp=args.vpp, **model_kwargs)
            else:
                chunks = tree_chunks(args.flavor, config, vpp=args.vpp, **model_kwargs)
        except (ValueError, AssertionError, NotImplementedError) as exc:  # the tree's own validation
            (Path(args.out) / f"refusal-rank{rank}.txt").write_text(
                f"{type(exc).__name__}: {exc}\n", encoding="utf-8"
            )
            raise SystemExit(REFUSED) from exc
    else:
        chunks = _our_chunks(args, common)
    models = chunks
    if args.bf16:  # megatron's mixed precision: the schedule runs the wrappers, the records read the chunks
        from megatron.core.transformer.module import Float16Module

        models = [Float16Module(c.config, c) for c in chunks]
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), args.tp
    names = [full_names(c) for c in chunks]

    out = Path(args.out)
    if args.init is None:
        assert args.pp == 1 and args.tp == 1, "only the reference run writes the initial weights"
        torch.save(
            {canonical_name(k): v.clone() for k, v in chunks[0].state_dict().items() if v is not None},
            out / "init.pt",
        )
    else:
        load_full_state(
            chunks, torch.load(args.init), source=f"--init {args.init}", tp_rank=tp_rank, tp_size=tp_size
        )

    g = torch.Generator().manual_seed(99)
    total = args.steps * args.microbatches
    tokens = torch.randint(0, m["vocab"], (total, m["mbs"], m["seq"] + 1), generator=g)
    causal = torch.triu(torch.ones(m["seq"], m["seq"], dtype=torch.bool), diagonal=1).view(
        1, 1, m["seq"], m["seq"]
    )
    position_ids = torch.arange(m["seq"]).unsqueeze(0).expand(m["mbs"], -1)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb[:, :-1], position_ids, causal, labels=mb[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone(), **_mtp_losses()}

        return output, loss_func

    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    fb = get_forward_backward_func()
    record: dict[str, Any] = {
        "losses": [],
        "aux_losses": [],
        "mtp_losses": [],
        "grads": [],
        "weights": [],
        "shapes": shapes,
        "rank": rank,
        "tensor_shape_calls": shape_calls,
        "dp_rank": ps.get_data_parallel_rank(),
    }
    for step in range(args.steps):
        opt.zero_grad(set_to_none=False)
        for c in chunks:
            c.zero_grad(set_to_none=False)
        # Data parallel (beside expert parallel): each DP rank its contiguous share of the step's microbatches.
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        local = args.microbatches // dp
        first = step * args.microbatches + dp_rank * local
        batch = [tokens[first + i] for i in range(local)]
        iters = [iter(batch) for _ in chunks]
        if args.crash_rank == rank:
            os._exit(17)
        if args.hang_rank == rank:
            while True:
                time.sleep(60)
        losses = fb(
            forward_step_func=forward_step,
            data_iterator=iters if args.vpp else iters[0],
            model=models if args.vpp else models[0],
            num_microbatches=local,
            seq_length=m["seq"],
            micro_batch_size=m["mbs"],
            forward_only=False,
        )
        _allreduce_sequence_parallel_grads(chunks, ps)
        if args.mtp:
            _allreduce_embedding_grads(chunks, ps)
        _average_data_parallel_grads(chunks, ps)
        record["losses"].append([float(d["lm loss"]) for d in losses])
        record["mtp_losses"].append(
            [[float(d[f"mtp_{k + 1} loss"]) for k in range(args.mtp)] for d in losses]
            if args.mtp
            else [[] for _ in losses]
        )
        record["aux_losses"].append(_aux_losses() if args.moe else {})
        record["grads"].append(_collect(chunks, names, lambda p: p.grad))
        opt.step()
        record["weights"].append(_collect(chunks, names, lambda p: p))
    torch.save(record, out / f"rank{rank}.pt")
    dist.barrier()
    ps.destroy_model_parallel()


def _recording(base: type, shapes: list) -> type:
    """`base` (a P2P communicator class) recording every shape it receives or sends into `shapes`."""

    class RecordingP2P(base):
        def _communicate(
            self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, **kw
        ):
            widened = self._widen(tensor_shape) if hasattr(self, "_widen") else tensor_shape
            if recv_prev:
                shapes.append(("recv_prev", tuple(widened)))
            if recv_next:
                shapes.append(("recv_next", tuple(widened)))
            if tensor_send_next is not None:
                shapes.append(("send_next", tuple(tensor_send_next.shape)))
            if tensor_send_prev is not None:
                shapes.append(("send_prev", tuple(tensor_send_prev.shape)))
            return super()._communicate(
                tensor_send_next=tensor_send_next,
                tensor_send_prev=tensor_send_prev,
                recv_prev=recv_prev,
                recv_next=recv_next,
                tensor_shape=tensor_shape,
                **kw,
            )

    return RecordingP2P


def _our_chunks(args: argparse.Namespace, common: dict) -> list:
    """This rank's chunks of the mhc_core GPT (one per virtual stage)."""
    from megatron.core import parallel_state as ps

    from mhc_core.megatron.config import MHCTransformerConfig
    from mhc_core.megatron.gpt import build_gpt_model

    m = MODEL
    numerics = (
        {"mhc_variant": "megatron_dev", "mhc_learned_contraction": True} if args.numerics == "dev" else {}
    )
    if args.single_pass:  # DeepSeek-V4.1: deepseek_v41's numerics with the model's RMS epsilon, single-pass
        numerics = {
            "mhc_single_pass": True,
            "mhc_variant": "megatron_dev",
            "mhc_norm_eps_inside_sqrt": True,
            "mhc_fp32_coefficients": True,
            "mhc_norm_eps": 1e-5,
            "mhc_handoff_precision": args.handoff,
        }
    config = MHCTransformerConfig(
        **common,
        enable_mhc_connections=not args.no_mhc,
        mhc_num_residual_streams=m["n"],
        **(numerics if not args.no_mhc else {}),
    )
    chunks = []
    for vp in range(args.vpp or 1):
        vp_stage = vp if args.vpp else None
        if args.hybrid:
            from mhc_core.megatron.gpt import MHCGPTModel
            from mhc_core.megatron.hybrid import hybrid_block_spec, hybrid_mtp_block_spec

            mtp = (
                {
                    "mtp_block_spec": hybrid_mtp_block_spec(config, args.hybrid, vp_stage=vp_stage),
                    "position_embedding_type": "rope",
                }
                if args.mtp
                else {}
            )
            chunks.append(
                MHCGPTModel(
                    config,
                    hybrid_block_spec(
                        config, args.hybrid, stage=ps.get_pipeline_model_parallel_rank(), vp_stage=vp_stage
                    ),
                    vocab_size=m["vocab"],
                    max_sequence_length=m["seq"],
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    vp_stage=vp_stage,
                    share_embeddings_and_output_weights=False,
                    **mtp,
                )
            )
            continue
        chunks.append(
            build_gpt_model(
                config,
                vocab_size=m["vocab"],
                max_sequence_length=m["seq"],
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                share_embeddings_and_output_weights=False,
                **({"position_embedding_type": "rope"} if args.mtp else {}),
            )
        )
    return chunks


def _collect(chunks, names, get):
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for chunk, nm in zip(chunks, names, strict=True):
        for local, p in chunk.named_parameters():
            split = getattr(p, "tensor_model_parallel", False) and tp_size > 1
            out[nm[local]] = {
                "value": get(p).detach().clone(),
                "partition_dim": p.partition_dim if split else None,
                "tp_rank": tp_rank,
                "tp_size": tp_size,
            }
    return out


def _average_data_parallel_grads(chunks, ps) -> None:
    """What megatron's DDP does with several data-parallel ranks: each gradient summed over its data-parallel group
    (an expert's over the expert-data-parallel one: the other ranks' tokens already reached it through the
    dispatcher) and divided by the data-parallel size."""
    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return
    for c in chunks:
        for p in c.parameters():
            if p.grad is None:
                continue
            expert = not getattr(p, "allreduce", True)
            group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)


def _hybrid_kwargs(pattern: str) -> dict:
    """Config keywords of `--hybrid`: its layer count, its stages as megatron-core's layout, MoE for `E`."""
    from mhc_core.megatron.hybrid import hybrid_layout, parse_pattern

    stages = parse_pattern(pattern)
    out: dict = {"num_layers": sum(len(s) for s in stages)}
    if len(stages) > 1:
        out["pipeline_model_parallel_layout"] = hybrid_layout(
            pattern
        )  # with the MTP depths' 'm' on the last stage
    if "E" in pattern:
        out.update(_moe_kwargs("alltoall"))
    return out


def _mtp_losses() -> dict[str, torch.Tensor]:
    """This microbatch's MTP loss per depth (`{"mtp_<k> loss": ...}`) from megatron-core's tracker, which is then
    zeroed, so each microbatch reads only its own; empty without MTP."""
    from mhc_core.megatron.mtp import tracked_mtp_losses

    values = tracked_mtp_losses()
    if values is None:
        return {}
    out = {f"mtp_{k + 1} loss": v.detach().clone() for k, v in enumerate(values)}
    values.zero_()
    return out


def _allreduce_embedding_grads(chunks, ps) -> None:
    """What megatron's finalize_model_grads does for the word embedding with MTP under pipeline stages: the first
    stage's and the MTP stage's copies sum their gradients over the embedding group."""
    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return
    for c in chunks:
        embedding = getattr(c, "embedding", None)
        if embedding is not None:
            dist.all_reduce(embedding.word_embeddings.weight.grad, group=ps.get_embedding_group())


def _allreduce_sequence_parallel_grads(chunks, ps) -> None:
    """What megatron's finalize_model_grads does for SP params (norms, mHC) without DDP wrappers."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    for c in chunks:
        for p in c.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


if __name__ == "__main__":
    main()
