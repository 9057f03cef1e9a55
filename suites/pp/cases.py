"""The pipelined runs of the pp suite: ranks, worker flags, the single-process reference each must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CASES", "Case"]


@dataclass(frozen=True, kw_only=True)
class Case:
    """One pipelined run: ranks, worker flags, the reference it must reproduce, its tolerance."""

    name: str
    nproc: int
    args: tuple[str, ...]
    mhc: bool = True
    reference: str = "mhc"
    """The single-process run it must reproduce (`ReferenceRuns.FLAGS`)."""
    rtol: float = 1e-6
    """TP splits every matmul's reduction, and data parallelism the sum over microbatches, so those cases allow
    fp32 reordering (documented)."""

    @property
    def reference_run(self) -> str:
        """The key of its single-process run in `ReferenceRuns.FLAGS`."""
        return self.reference if self.mhc else "no-mhc"


CASES = [
    Case(name="pp2", nproc=2, args=("--pp", "2")),
    Case(name="pp4", nproc=4, args=("--pp", "4")),
    Case(name="pp2-vpp2", nproc=2, args=("--pp", "2", "--vpp", "2")),
    Case(name="pp2-embedding-loss-stages", nproc=2, args=("--pp", "2", "--embedding-stage", "--loss-stage")),
    Case(name="tp2-pp2", nproc=4, args=("--tp", "2", "--pp", "2"), rtol=5e-6),
    Case(name="pp2-vpp2-no-mhc", nproc=2, args=("--pp", "2", "--vpp", "2", "--no-mhc"), mhc=False),
    # mHC recompute: the chunk-spanning groups are rebuilt in backward under the interleaved schedule.
    Case(name="pp2-vpp2-mhc-recompute", nproc=2, args=("--pp", "2", "--vpp", "2", "--mhc-recompute", "chunk")),
    # MoE MLPs (4 local experts, top-2, alltoall) under the MLP-side hyper connection; the routers'
    # load-balancing losses are compared per layer too.
    Case(name="pp2-moe", nproc=2, args=("--pp", "2", "--moe", "alltoall"), reference="mhc-moe"),
    Case(name="pp2-vpp2-moe", nproc=2, args=("--pp", "2", "--vpp", "2", "--moe", "alltoall"), reference="mhc-moe"),
    # Expert parallel: two experts per rank, tokens exchanged by the alltoall dispatcher over gloo, the two ranks
    # data-parallel (two microbatches each, gradients averaged as megatron's DDP does: each rank's microbatches
    # scaled by 1/2 and summed, then the ranks, where one process scales four by 1/4: fp32 reordering, measured
    # 5.4e-6 relative at worst, on an mHC alpha's gradient).
    Case(name="ep2-moe", nproc=2, args=("--ep", "2", "--moe", "alltoall"), reference="mhc-moe", rtol=1e-5),
    # Two MTP depths on the last stage (dev's numerics: each depth its own learned contraction), every
    # microbatch's mtp_1 / mtp_2 loss compared too. The word embedding's gradient is summed over the first and the
    # MTP stage (an all-reduce, as megatron's finalize_model_grads does) where one process accumulates both uses in
    # autograd's order: fp32 reordering, which moves the second step's gradients (measured in docs/pipeline.md).
    Case(name="pp2-mtp", nproc=2, args=("--pp", "2", "--mtp", "2", "--numerics", "dev"), reference="mhc-mtp",
         rtol=1e-5),
    Case(name="pp2-vpp2-mtp", nproc=2, args=("--pp", "2", "--vpp", "2", "--mtp", "2", "--numerics", "dev"),
         reference="mhc-mtp", rtol=1e-5),
    # PP 4 with the MTP depths and the loss on a stage of their own (no decoder layer there): the streams cross
    # into it, and it contracts them (megatron-core would put the final layernorm with the last decoder layer).
    Case(name="pp4-mtp-loss-stage", nproc=4, args=("--pp", "4", "--mtp", "2", "--numerics", "dev", "--layout",
                                                  "Et|tt|t|mmL"), reference="mhc-mtp", rtol=1e-5),
    # The hybrid stack (one hyper connection per layer: attention, MLP, attention, MoE) split at the pattern's
    # `|`: two stages, four, two of two virtual stages; and EP 2 (data parallel: measured 1.4e-6).
    Case(name="pp2-hybrid", nproc=2, args=("--pp", "2", "--hybrid", "*-|*E"), reference="mhc-hybrid"),
    Case(name="pp4-hybrid", nproc=4, args=("--pp", "4", "--hybrid", "*|-|*|E"), reference="mhc-hybrid"),
    Case(name="pp2-vpp2-hybrid", nproc=2, args=("--pp", "2", "--vpp", "2", "--hybrid", "*|-|*|E"),
         reference="mhc-hybrid"),
    Case(name="ep2-hybrid", nproc=2, args=("--ep", "2", "--hybrid", "*-*E"), reference="mhc-hybrid", rtol=1e-5),
    # DeepSeek-V4's shape: the hybrid stack with an MTP depth of its own pattern (`*-|*E/*E`: dev's unified form,
    # the depth's attention and MoE nested on the n streams) on the last stage, dev's numerics. The word embedding's
    # two copies sum their gradients over the embedding group, as in pp2-mtp: the same bound.
    Case(name="pp2-hybrid-mtp", nproc=2, args=("--pp", "2", "--hybrid", "*-|*E/*E", "--numerics", "dev"),
         reference="mhc-hybrid-mtp", rtol=1e-5),
    # TP 2 x PP 2 with MoE, which megatron-core runs sequence parallel only: the local spec's norms take it here
    # (mhc_core.megatron.norms). Each TP rank holds half the tokens, so every replicated parameter's gradient is
    # summed over the two ranks where one process sums all tokens at once: fp32 reordering, measured 1.0e-5
    # relative at worst, on an alpha_res gradient of 1e-9 (docs/pipeline.md).
    Case(name="tp2-pp2-sp-moe", nproc=4, args=("--tp", "2", "--pp", "2", "--sp", "--moe", "alltoall"),
         reference="mhc-moe", rtol=2e-5),
]
