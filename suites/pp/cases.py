"""The pipelined runs of the pp suite: ranks, worker flags, the single-process reference each must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BF16_CASES", "CASES", "HIDDEN", "N", "SINGLE_PASS_CASES", "Case"]

HIDDEN, N = 32, 4
"""C and n of the worker's model (`pp_worker.MODEL`)."""


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
    fp32 reordering (documented); 0: bit for bit."""

    @property
    def reference_run(self) -> str:
        """The key of its single-process run in `ReferenceRuns.FLAGS`."""
        return self.reference if self.mhc else "no-mhc"

    @property
    def width(self) -> int:
        """The last dim of every P2P hop: C without mHC, n*C with it; single-pass, the carrier's n*C + k (k = n for
        an fp32 pipeline or a mix rounded to the pipeline dtype, 2n for the fp32 mix's bytes in a bf16 one)."""
        if not self.mhc:
            return HIDDEN
        if "--single-pass" not in self.args:
            return HIDDEN * N
        wide = "--bf16" in self.args and "pipeline_dtype" not in self.args
        return HIDDEN * N + (2 * N if wide else N)


CASES = [
    Case(name="pp2", nproc=2, args=("--pp", "2")),
    Case(name="pp4", nproc=4, args=("--pp", "4")),
    Case(name="pp2-vpp2", nproc=2, args=("--pp", "2", "--vpp", "2")),
    Case(name="pp2-embedding-loss-stages", nproc=2, args=("--pp", "2", "--embedding-stage", "--loss-stage")),
    Case(name="tp2-pp2", nproc=4, args=("--tp", "2", "--pp", "2"), rtol=5e-6),
    Case(name="pp2-vpp2-no-mhc", nproc=2, args=("--pp", "2", "--vpp", "2", "--no-mhc"), mhc=False),
    # mHC recompute: the chunk-spanning groups are rebuilt in backward under the interleaved schedule.
    Case(
        name="pp2-vpp2-mhc-recompute", nproc=2, args=("--pp", "2", "--vpp", "2", "--mhc-recompute", "chunk")
    ),
    # MoE MLPs (4 local experts, top-2, alltoall) under the MLP-side hyper connection; the routers'
    # load-balancing losses are compared per layer too.
    Case(name="pp2-moe", nproc=2, args=("--pp", "2", "--moe", "alltoall"), reference="mhc-moe"),
    Case(
        name="pp2-vpp2-moe",
        nproc=2,
        args=("--pp", "2", "--vpp", "2", "--moe", "alltoall"),
        reference="mhc-moe",
    ),
    # Expert parallel: two experts per rank, tokens exchanged by the alltoall dispatcher over gloo, the two ranks
    # data-parallel (two microbatches each, gradients averaged as megatron's DDP does: each rank's microbatches
    # scaled by 1/2 and summed, then the ranks, where one process scales four by 1/4: fp32 reordering, measured
    # 5.4e-6 relative at worst, on an mHC alpha's gradient).
    Case(name="ep2-moe", nproc=2, args=("--ep", "2", "--moe", "alltoall"), reference="mhc-moe", rtol=1e-5),
    # Two MTP depths on the last stage (dev's numerics: each depth its own learned contraction), every
    # microbatch's mtp_1 / mtp_2 loss compared too. The word embedding's gradient is summed over the first and the
    # MTP stage (an all-reduce, as megatron's finalize_model_grads does) where one process accumulates both uses in
    # autograd's order: fp32 reordering, which moves the second step's gradients (measured in docs/pipeline.md).
    Case(
        name="pp2-mtp",
        nproc=2,
        args=("--pp", "2", "--mtp", "2", "--numerics", "dev"),
        reference="mhc-mtp",
        rtol=1e-5,
    ),
    Case(
        name="pp2-vpp2-mtp",
        nproc=2,
        args=("--pp", "2", "--vpp", "2", "--mtp", "2", "--numerics", "dev"),
        reference="mhc-mtp",
        rtol=1e-5,
    ),
    # PP 4 with the MTP depths and the loss on a stage of their own (no decoder layer there): the streams cross
    # into it, and it contracts them (megatron-core would put the final layernorm with the last decoder layer).
    Case(
        name="pp4-mtp-loss-stage",
        nproc=4,
        args=("--pp", "4", "--mtp", "2", "--numerics", "dev", "--layout", "Et|tt|t|mmL"),
        reference="mhc-mtp",
        rtol=1e-5,
    ),
    # The hybrid stack (one hyper connection per layer: attention, MLP, attention, MoE) split at the pattern's
    # `|`: two stages, four, two of two virtual stages; and EP 2 (data parallel: measured 1.4e-6).
    Case(name="pp2-hybrid", nproc=2, args=("--pp", "2", "--hybrid", "*-|*E"), reference="mhc-hybrid"),
    Case(name="pp4-hybrid", nproc=4, args=("--pp", "4", "--hybrid", "*|-|*|E"), reference="mhc-hybrid"),
    Case(
        name="pp2-vpp2-hybrid",
        nproc=2,
        args=("--pp", "2", "--vpp", "2", "--hybrid", "*|-|*|E"),
        reference="mhc-hybrid",
    ),
    Case(
        name="ep2-hybrid", nproc=2, args=("--ep", "2", "--hybrid", "*-*E"), reference="mhc-hybrid", rtol=1e-5
    ),
    # DeepSeek-V4's shape: the hybrid stack with an MTP depth of its own pattern (`*-|*E/*E`: dev's unified form,
    # the depth's attention and MoE nested on the n streams) on the last stage, dev's numerics. The word embedding's
    # two copies sum their gradients over the embedding group, as in pp2-mtp: the same bound.
    Case(
        name="pp2-hybrid-mtp",
        nproc=2,
        args=("--pp", "2", "--hybrid", "*-|*E/*E", "--numerics", "dev"),
        reference="mhc-hybrid-mtp",
        rtol=1e-5,
    ),
    # TP 2 x PP 2 with MoE, which megatron-core runs sequence parallel only: the local spec's norms take it here
    # (mhc_core.megatron.norms). Each TP rank holds half the tokens, so every replicated parameter's gradient is
    # summed over the two ranks where one process sums all tokens at once: fp32 reordering, measured 1.0e-5
    # relative at worst, on an alpha_res gradient of 1e-9 (docs/pipeline.md).
    Case(
        name="tp2-pp2-sp-moe",
        nproc=4,
        args=("--tp", "2", "--pp", "2", "--sp", "--moe", "alltoall"),
        reference="mhc-moe",
        rtol=2e-5,
    ),
]


BF16_CASES = [
    # megatron-core's bf16 mixed precision (Float16Module, a bf16 pipeline) with dev's numerics, the mHC parameters
    # kept fp32: the dense GPT and DeepSeek-V4's hybrid shape (`*E|*E`) over two stages. The n-stream bf16 state
    # crosses the boundary as the single process hands it from layer to layer: bitwise.
    Case(
        name="pp2-bf16",
        nproc=2,
        args=("--pp", "2", "--bf16", "--numerics", "dev"),
        reference="mhc-dev-bf16",
        rtol=0.0,
    ),
    Case(
        name="pp2-hybrid-bf16",
        nproc=2,
        args=("--pp", "2", "--hybrid", "*E|*E", "--bf16", "--numerics", "dev"),
        reference="mhc-hybrid-dev-bf16",
        rtol=0.0,
    ),
]
"""The per-sublayer form in bf16 (the single-pass form's are in `SINGLE_PASS_CASES`)."""

CASES += BF16_CASES


def _single_pass(
    name: str, nproc: int, args: tuple[str, ...], *, reference: str, rtol: tuple[float, float]
) -> list[Case]:
    """The single-pass case `name` in fp32 and in bf16 (megatron's mixed precision, a bf16 pipeline), each against
    the single process of its own dtype, at `rtol` (fp32, bf16)."""
    return [
        Case(
            name=f"sp-{name}", nproc=nproc, args=("--single-pass", *args), reference=reference, rtol=rtol[0]
        ),
        Case(
            name=f"sp-{name}-bf16",
            nproc=nproc,
            args=("--single-pass", "--bf16", *args),
            reference=f"{reference}-bf16",
            rtol=rtol[1],
        ),
    ]


BITWISE = (0.0, 0.0)
"""PP, VPP and the standalone stages change no arithmetic: the pipelined run is the single process bit for bit,
in fp32 and in bf16, with the H_pre crossing every boundary unrounded."""

SINGLE_PASS_CASES = [
    # DeepSeek-V4.1's single-pass form: the H_pre the next sublayer aggregates with crosses every boundary behind
    # the streams (the carrier, mhc_core.handoff).
    *_single_pass("pp2", 2, ("--pp", "2"), reference="sp", rtol=BITWISE),
    *_single_pass("pp4", 4, ("--pp", "4"), reference="sp", rtol=BITWISE),
    *_single_pass("pp2-vpp2", 2, ("--pp", "2", "--vpp", "2"), reference="sp", rtol=BITWISE),
    *_single_pass(
        "pp2-embedding-loss-stages",
        2,
        ("--pp", "2", "--embedding-stage", "--loss-stage"),
        reference="sp",
        rtol=BITWISE,
    ),
    # The recomputes with the handoff crossing each group, checkpoint and stage: mHC recompute (whole chunks) under
    # the interleaved schedule, and full recompute one layer per checkpoint.
    *_single_pass(
        "pp2-vpp2-mhc-recompute",
        2,
        ("--pp", "2", "--vpp", "2", "--mhc-recompute", "chunk"),
        reference="sp",
        rtol=BITWISE,
    ),
    *_single_pass("pp2-full-recompute", 2, ("--pp", "2", "--full-recompute"), reference="sp", rtol=BITWISE),
    # TP 2 splits every row-parallel matmul's reduction over two ranks: fp32 reordering (measured 3.6e-6), and in
    # bf16 one rounding of each partial sum more, which moves the smallest gradients most: the last sublayer's
    # alpha_pre and bias (1e-5, reached through the exit only) by 5.6e-2 of their size (docs/pipeline.md).
    *_single_pass("tp2-pp2", 4, ("--tp", "2", "--pp", "2"), reference="sp", rtol=(5e-6, 8e-2)),
    # DeepSeek-V4.1's shape: attention and MoE alternating under one hyper connection each (`*E*E`), over two
    # stages, and with its experts over EP 2 (the two ranks data-parallel: the sum over microbatches reordered).
    *_single_pass("pp2-hybrid", 2, ("--pp", "2", "--hybrid", "*E|*E"), reference="sp-hybrid", rtol=BITWISE),
    # (measured 3.5e-6 in fp32, 5.7e-2 in bf16 on the last layer's alpha_pre, as under TP 2).
    *_single_pass(
        "ep2-hybrid", 2, ("--ep", "2", "--hybrid", "*E*E"), reference="sp-hybrid", rtol=(1e-5, 8e-2)
    ),
]
"""The single-pass matrix, fp32 and bf16 (the `rtol`s: measured, `docs/pipeline.md`)."""

CASES += SINGLE_PASS_CASES

ROUNDED_HANDOFF = Case(
    name="sp-pp4-bf16-rounded-handoff",
    nproc=4,
    args=("--single-pass", "--bf16", "--pp", "4", "--handoff", "pipeline_dtype"),
    reference="sp-bf16",
    rtol=0.0,
)
"""Upstream DSv41HybridStack's choice: the H_pre rounded to bf16 at each of the three boundaries. It must NOT equal
the single process: the suite measures what that rounding costs, by layer (`test_pp_runs.py`)."""
