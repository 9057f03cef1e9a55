"""Flags of upstream's GPU recipes that this runner reads but does not implement: typed, each with why.

Upstream's functional recipes (Megatron-LM's `tests/functional_tests/test_cases/`) carry flags for features a CPU
runner has no use for (TensorBoard logging, the evaluation loop) and for features it does not train with
(multi-latent and DeepSeek-V4 attention, sparse indexers, packed variable-length data, context parallelism). A
recipe transcribed from upstream keeps them so that it stays upstream's recipe: `parse_model_args` validates each
by its type here and records it in `TrainArgs.upstream`; the trainer refuses a run that sets a `refused` one
(naming each flag and why), and ignores the others (`refused=False`: logging and I/O, no effect on the numbers).
`ALIASES` are upstream dev's names of fields this runner has under upstream main's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ALIASES", "UPSTREAM_FLAGS", "UpstreamFlag", "refused"]


@dataclass(frozen=True, kw_only=True)
class UpstreamFlag:
    """One flag: its value type (`bool`, `int`, `float`, `str`), whether a run that sets it is refused, and why."""

    kind: type
    refused: bool
    why: str


def _r(kind: type, why: str) -> UpstreamFlag:
    return UpstreamFlag(kind=kind, refused=True, why=why)


def _i(kind: type, why: str) -> UpstreamFlag:
    return UpstreamFlag(kind=kind, refused=False, why=why)


_MLA = (
    "multi-latent attention (TE's and megatron-core's MLA modules; the local GPT spec has standard attention)"
)
_DSV4 = "DeepSeek-V4's hybrid attention (CSA / HCA / SWA with a sparse indexer: TE-only in upstream's specs)"
_VARLEN = "packed variable-length (THD) data with a sequence-packing scheduler (this runner trains fixed-length batches)"
_LOG = "logging / I/O only (no effect on the numbers this runner compares)"

UPSTREAM_FLAGS: dict[str, UpstreamFlag] = {
    "--multi-latent-attention": _r(bool, _MLA),
    "--q-lora-rank": _r(int, _MLA),
    "--kv-lora-rank": _r(int, _MLA),
    "--qk-head-dim": _r(int, _MLA),
    "--qk-pos-emb-head-dim": _r(int, _MLA),
    "--v-head-dim": _r(int, _MLA),
    "--spec": _r(str, "a module spec by import path (this runner builds its own local specs)"),
    "--experimental-attention-variant": _r(str, _DSV4),
    "--dsa-indexer-n-heads": _r(int, _DSV4),
    "--dsa-indexer-head-dim": _r(int, _DSV4),
    "--dsa-indexer-topk": _r(int, _DSV4),
    "--dsa-indexer-loss-coeff": _r(float, _DSV4),
    "--dsa-indexer-use-sparse-loss": _r(bool, _DSV4),
    "--csa-window-size": _r(int, _DSV4),
    "--csa-compress-ratios": _r(str, _DSV4),
    "--csa-compress-rotary-base": _r(int, _DSV4),
    "--dsa-kernel-backend": _r(str, _DSV4),
    "--use-varlen-dataset": _r(bool, _VARLEN),
    "--varlen-mock-dataset-config-json": _r(str, _VARLEN),
    "--sequence-packing-scheduler": _r(str, _VARLEN),
    "--max-seqlen-per-dp-cp-rank": _r(int, _VARLEN),
    "--pad-packed-seq-alignment": _r(str, _VARLEN),
    "--thd-tail-padding-policy": _r(str, _VARLEN),
    "--thd-max-packed-sequences": _r(int, _VARLEN),
    "--calculate-per-token-loss": _r(
        bool, "per-token loss normalization (this runner averages per micro-batch)"
    ),
    "--context-parallel-size": _r(int, "context parallelism (this runner splits no sequence across ranks)"),
    "--cp-partition-mode": _r(str, "context parallelism (this runner splits no sequence across ranks)"),
    "--cuda-graph-dynamic-microbatches": _r(bool, "CUDA graph capture (upstream's training loop drives it)"),
    "--log-params-norm": _i(bool, _LOG),
    "--log-validation-ppl-to-tensorboard": _i(bool, _LOG),
    "--log-timers-to-tensorboard": _i(bool, _LOG),
    "--log-memory-to-tensorboard": _i(bool, _LOG),
    "--tensorboard-dir": _i(str, _LOG),
    "--timing-log-level": _i(int, _LOG),
    "--log-interval": _i(int, _LOG),
    "--eval-interval": _i(int, "the evaluation loop (this runner trains only)"),
    "--eval-iters": _i(int, "the evaluation loop (this runner trains only)"),
    "--save": _i(str, "the checkpoint directory (this runner's launcher chooses it)"),
    "--load": _i(str, "the checkpoint directory (this runner's launcher chooses it)"),
    "--data-cache-path": _i(str, _LOG),
    "--dataloader-type": _i(
        str, "the data loader's sampler (this runner's is megatron-core's pretraining sampler)"
    ),
    "--distributed-backend": _i(
        str, "the process-group backend (this runner picks it by the hardware: gloo, nccl)"
    ),
    "--use-mcore-models": _i(bool, "megatron-core's models (this runner has no other)"),
    "--no-gradient-accumulation-fusion": _i(bool, "a fused CUDA kernel switch (none on this runner)"),
}
"""Every upstream-only flag this runner reads (see the module docstring)."""

ALIASES: dict[str, str] = {
    "--enable-hyper-connections": "--enable-mhc-connections",
    "--num-residual-streams": "--mhc-num-residual-streams",
}
"""Upstream dev's names of mHC's config fields -> upstream main's, which this runner's flags follow."""


def refused(upstream: Mapping[str, object]) -> list[str]:
    """`--flag=value: why` for each refused flag of `upstream` (`TrainArgs.upstream` as a mapping) that is set."""
    return [
        f"{flag}={value!r}: {UPSTREAM_FLAGS[flag].why}"
        for flag, value in upstream.items()
        if UPSTREAM_FLAGS[flag].refused and value not in (False, None)
    ]
