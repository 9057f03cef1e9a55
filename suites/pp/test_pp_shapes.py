"""Pipeline shape rules and layer counts (single process: megatron-core's own functions)."""

from __future__ import annotations

import pytest
import torch

from mhc_core.megatron.config import MHCTransformerConfig
from mhc_core.megatron.pipeline import get_tensor_shapes, interleaved_tensor_shape
from mhc_core.megatron.pipeline_split import PipelineSplit

H, N, SEQ, MBS = 64, 4, 32, 2


class Group:
    """A process group's rank and size (all `get_tensor_shapes` reads)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _config(*, mhc=True, tp=1, pp=2, vpp=None, sp=False, cp=1, layers=8, **kw) -> MHCTransformerConfig:
    return MHCTransformerConfig(
        num_layers=layers,
        hidden_size=H,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        pipeline_dtype=torch.float32,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=N,
        **kw,
    )


def _shapes(config, pp, tp=1, cp=1):
    out = []
    for r in range(pp):
        kw = dict(
            seq_length=SEQ,
            micro_batch_size=MBS,
            decoder_seq_length=None,
            config=config,
            tp_group=Group(0, tp),
            cp_group=Group(0, cp),
            pp_group=Group(r, pp),
        )
        out.append((get_tensor_shapes(**kw, is_recv=True)[0], get_tensor_shapes(**kw, is_recv=False)[0]))
    return out


@pytest.mark.parametrize("pp", [2, 4], ids=lambda v: f"pp{v}")
@pytest.mark.parametrize("sp_tp", [(False, 1), (True, 2)], ids=["sp-off", "sp-tp2"])
@pytest.mark.parametrize("cp", [1, 2], ids=lambda v: f"cp{v}")
@pytest.mark.parametrize("mhc", [True, False], ids=["mhc", "no-mhc"])
def test_1f1b_send_matches_next_receive(pp, sp_tp, cp, mhc):
    """send[r] == recv[r+1]; n*C on recv of r > 0 and send of r < last with mHC; C everywhere without."""
    sp, tp = sp_tp
    shapes = _shapes(_config(mhc=mhc, tp=tp, pp=pp, sp=sp, cp=cp), pp, tp=tp, cp=cp)
    s = SEQ // cp // (tp if sp else 1)
    for r in range(pp - 1):
        assert shapes[r][1] == shapes[r + 1][0]
    for r, (recv, send) in enumerate(shapes):
        assert recv == (s, MBS, H * N if mhc and r > 0 else H)
        assert send == (s, MBS, H * N if mhc and r < pp - 1 else H)


SINGLE_PASS = dict(mhc_single_pass=True, mhc_variant="megatron_dev", mhc_norm_eps_inside_sqrt=True)


@pytest.mark.parametrize(
    "dtype,coefficients,handoff,k",
    [
        (torch.float32, True, "exact", N),
        (torch.bfloat16, True, "exact", 2 * N),
        (torch.bfloat16, False, "exact", N),
        (torch.bfloat16, True, "pipeline_dtype", N),
    ],
    ids=["fp32", "bf16-fp32-mix", "bf16-bf16-mix", "bf16-rounded"],
)
def test_single_pass_carries_the_mix_behind_the_streams(dtype, coefficients, handoff, k):
    """Single-pass: every hop is n*C + k, k = n where the mix has the pipeline's dtype (or is rounded to it), 2n for
    an fp32 mix's bytes in a bf16 pipeline; 1F1B and the interleaved schedule alike."""
    cfg = _config(
        pp=2, vpp=2, **SINGLE_PASS, mhc_fp32_coefficients=coefficients, mhc_handoff_precision=handoff
    )
    cfg.pipeline_dtype = dtype
    shapes = _shapes(cfg, 2)
    assert shapes[0][1] == shapes[1][0] == (SEQ, MBS, H * N + k) and shapes[0][0] == (SEQ, MBS, H)
    got = interleaved_tensor_shape(
        seq_length=SEQ, micro_batch_size=MBS, config=cfg, tp_size=1, cp_size=1, pp_size=2
    )
    assert got == (SEQ, MBS, H * N + k)


def test_a_rounded_handoff_is_single_pass_only():
    """`mhc_handoff_precision` other than exact without the single-pass form is an error naming it."""
    with pytest.raises(ValueError, match="mhc_handoff_precision='pipeline_dtype': is a single-pass setting"):
        _config(mhc_handoff_precision="pipeline_dtype")
    with pytest.raises(ValueError, match="mhc_handoff_precision='bf16': valid: exact, pipeline_dtype"):
        _config(**SINGLE_PASS, mhc_handoff_precision="bf16")


def test_pp1_and_no_group_keep_megatron_shapes():
    """PP = 1, or no pp group, gives megatron-core's own shape."""
    cfg = _config(pp=1)
    kw = dict(
        seq_length=SEQ,
        micro_batch_size=MBS,
        decoder_seq_length=None,
        config=cfg,
        tp_group=Group(0, 1),
        cp_group=Group(0, 1),
    )
    assert get_tensor_shapes(**kw, pp_group=Group(0, 1)) == [(SEQ, MBS, H)]
    assert get_tensor_shapes(**kw) == [(SEQ, MBS, H)]


@pytest.mark.parametrize("mhc", [True, False], ids=["mhc", "no-mhc"])
@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
def test_interleaved_shape_is_n_streams_on_every_hop(mhc, sp):
    """VPP: one shape for every hop, n*C with mHC and PP > 1; PP = 1 stays C."""
    cfg = _config(mhc=mhc, tp=2, pp=2, vpp=2, sp=sp)
    s = SEQ // (2 if sp else 1)
    got = interleaved_tensor_shape(
        seq_length=SEQ, micro_batch_size=MBS, config=cfg, tp_size=2, cp_size=1, pp_size=2
    )
    assert got == (s, MBS, H * N if mhc else H)
    assert (
        interleaved_tensor_shape(
            seq_length=SEQ, micro_batch_size=MBS, config=cfg, tp_size=2, cp_size=1, pp_size=1
        )[-1]
        == H
    )


@pytest.mark.parametrize(
    "kw", [{"cp_size": 0}, {"tp_size": "2"}, {"seq_length": 0}], ids=["cp0", "tp-str", "seq0"]
)
def test_interleaved_shape_names_a_bad_size(kw):
    """A size that is not an integer >= 1 is a ValueError naming it (cp_size = 0 divided by zero)."""
    cfg = _config(mhc=True, tp=2, pp=2, vpp=2, sp=False)
    args = {
        "seq_length": SEQ,
        "micro_batch_size": MBS,
        "config": cfg,
        "tp_size": 2,
        "cp_size": 1,
        "pp_size": 2,
    } | kw
    name, value = next(iter(kw.items()))
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be an integer >= 1"):
        interleaved_tensor_shape(**args)


def _counts(config, pp, vpp):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    counts = {}
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    ps.set_pipeline_model_parallel_world_size(pp)
    try:
        for r in range(pp):
            ps.set_pipeline_model_parallel_rank(r)
            for v in range(vpp or 1):
                counts[(r, v)] = get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=r)
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
    return counts


LAYER_CASES = [
    ("pp2-l8", dict(pp=2, layers=8), {(0, 0): 4, (1, 0): 4}),
    (
        "pp2-l8-embed-loss",
        dict(
            pp=2,
            layers=8 - 2 + 2,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        {(0, 0): 4, (1, 0): 4},
    ),
    (
        "pp4-l14-embed-loss",
        dict(
            pp=4,
            layers=14,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        {(0, 0): 3, (1, 0): 4, (2, 0): 4, (3, 0): 3},
    ),
    ("pp2-vpp2-l8", dict(pp=2, vpp=2, layers=8), {(0, 0): 2, (0, 1): 2, (1, 0): 2, (1, 1): 2}),
    (
        "pp4-vpp2-l14-embed-loss",
        dict(
            pp=4,
            vpp=2,
            layers=14,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        {(0, 0): 1, (3, 1): 1}
        | {(r, v): 2 for r in range(4) for v in range(2) if (r, v) not in ((0, 0), (3, 1))},
    ),
    (
        "pp2-vpp2-layout",
        dict(
            pp=2,
            vpp=None,
            layers=7,
            pipeline_model_parallel_layout=[["embedding"], ["decoder"] * 6, ["decoder"], ["loss"]],
        ),
        {(0, 0): 0, (1, 0): 6, (0, 1): 1, (1, 1): 0},
    ),
    (
        "pp2-vpp2-layout-empty-stage",
        dict(
            pp=2,
            vpp=None,
            layers=6,
            pipeline_model_parallel_layout=[["embedding"], ["decoder"] * 6, [], ["loss"]],
        ),
        {(0, 0): 0, (1, 0): 6, (0, 1): 0, (1, 1): 0},
    ),
]


@pytest.mark.parametrize("name, kw, expected", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_counts_identical_with_and_without_mhc(name, kw, expected):
    """Layers per (pp rank, vp stage) are as megatron-core splits them, with or without mHC."""
    kw = dict(kw)
    pp, vpp = kw.pop("pp"), kw.pop("vpp", None)
    if "pipeline_model_parallel_layout" in kw:
        vpp = 2
    with_mhc = _counts(_config(mhc=True, pp=pp, vpp=vpp, **kw), pp, vpp)
    without = _counts(_config(mhc=False, pp=pp, vpp=vpp, **kw), pp, vpp)
    assert with_mhc == without == expected


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(num_layers=7, pipeline_model_parallel_size=2),
            r"num_layers=7 \+ 0 standalone stage\(s\) = 7 is not divisible by pipeline_model_parallel_size=2",
        ),
        (
            dict(
                num_layers=12,
                pipeline_model_parallel_size=4,
                account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True,
            ),
            r"num_layers=12 \+ 2 standalone stage\(s\) = 14 is not divisible by pipeline_model_parallel_size=4",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True,
            ),
            r"5 layer slot\(s\) per pipeline rank \(10 / 2\) are not divisible by virtual_pipeline_model_parallel_size=2",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttL"),
            r"the layout holds 4 decoder layer\(s\) but num_layers=8",
        ),
        (
            dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="tt|tL"),
            r"must start with exactly one embedding",
        ),
        (
            dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|tL"),
            r"3 stage\(s\), not a multiple of pipeline_model_parallel_size=2",
        ),
        (dict(num_layers="8", pipeline_model_parallel_size=2), r"num_layers='8' must be an integer"),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2.0),
            r"pipeline_model_parallel_size=2.0 must be an integer",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split="no"),
            r"account_for_embedding_in_pipeline_split='no' must be True or False",
        ),
        (
            dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*|ttL"),
            r"'t'\* without a repeat count in 'Et\*\|ttL'",
        ),
        (
            dict(
                num_layers=2,
                pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout=[["embedding", "decodr"], ["decoder", "loss"]],
            ),
            r"stage 0 holds unknown layer kinds \['decodr'\]",
        ),
        (
            dict(num_layers=2, pipeline_model_parallel_size=2, pipeline_model_parallel_layout=["Ett", "ttL"]),
            r"expected a string such as 'Et\|tt\|tL' or a list of stages",
        ),
    ],
    ids=[
        "not-divisible",
        "standalone-not-divisible",
        "vpp-not-divisible",
        "layout-count",
        "layout-no-embedding",
        "layout-stages",
        "layers-str",
        "pp-float",
        "embedding-flag-str",
        "layout-no-count",
        "layout-unknown-kind",
        "layout-list-of-str",
    ],
)
def test_bad_split_fails_before_any_process_group(kw, match):
    """A bad split is a ValueError naming the numbers, raised without torch.distributed."""
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=match):
        PipelineSplit(**kw)


def test_good_splits_pass():
    """The splits of the multi-process cases are accepted."""
    PipelineSplit(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    PipelineSplit(
        num_layers=4,
        pipeline_model_parallel_size=2,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    )
    PipelineSplit(
        num_layers=7,
        pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout=[["embedding"], ["decoder"] * 6, ["decoder"], ["loss"]],
    )
