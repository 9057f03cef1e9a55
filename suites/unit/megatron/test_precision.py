"""mHC parameters under megatron-core's `Float16Module` (bf16): kept fp32 for `megatron_dev`, cast for `megatron_main`.

The chain is the real one the functional runner uses: `Float16Module` -> `DistributedDataParallel`
-> megatron's schedule -> `get_megatron_optimizer(bf16=True)` (on CPU through `cpu_support`'s `param_types`:
megatron's bf16 optimizers accept only `torch.cuda.*` parameters), plain and distributed.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("megatron_world")

MHC_NAMES = ("hyper_connection", "hc_head_")


def _is_mhc(name: str) -> bool:
    return any(k in name for k in MHC_NAMES)


def _bf16_model(make_config, build_gpt, variant: str, learned: bool):
    """`(config, Float16Module(MHCGPTModel))` with bf16 params / pipeline dtype, n = 2."""
    from megatron.core.transformer.module import Float16Module

    extra = {"mhc_learned_contraction": True} if learned else {}
    config = make_config(
        n=2,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        mhc_variant=variant,
        **extra,
    )
    return config, Float16Module(config, build_gpt(config))


def _ddp_forward_backward(config, model, batch, distributed: bool = False):
    """megatron DDP around `model`, one micro-batch through megatron's schedule; returns the DDP model."""
    from suites.unit.megatron.test_cpu_support import _ddp, _forward_backward

    ddp = _ddp(config, model, distributed)
    _forward_backward(config, ddp, batch)
    return ddp


@pytest.mark.parametrize("learned", [False, True], ids=["mean-exit", "learned-exit"])
def test_dev_keeps_mhc_params_fp32_through_float16module(make_config, build_gpt, learned):
    """megatron_dev: every mHC parameter (and the learned-exit head) is fp32 after Float16Module; the rest bf16."""
    _, model = _bf16_model(make_config, build_gpt, "megatron_dev", learned)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    mhc = {n: d for n, d in dtypes.items() if _is_mhc(n)}
    rest = {n: d for n, d in dtypes.items() if not _is_mhc(n)}
    assert mhc and set(mhc.values()) == {torch.float32}, mhc
    assert rest and set(rest.values()) == {torch.bfloat16}, rest
    assert any("hc_head_fn" in n for n in mhc) == learned


def test_main_casts_mhc_params_with_the_model(make_config, build_gpt):
    """megatron_main (upstream main): Float16Module casts the mHC parameters to bf16 like every other."""
    _, model = _bf16_model(make_config, build_gpt, "megatron_main", False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_dev_bf16_backward_through_ddp_fills_fp32_mhc_grads(make_config, build_gpt, batch):
    """megatron_dev in bf16 under DDP: one schedule step gives every fp32 mHC param a finite main_grad,
    non-zero except the alpha_res gradients that vanish by the math."""
    from suites.unit.megatron.test_gpt import _structurally_zero

    config, model = _bf16_model(make_config, build_gpt, "megatron_dev", True)
    ddp = _ddp_forward_backward(config, model, batch)
    mhc = {n: p for n, p in ddp.named_parameters() if _is_mhc(n)}
    assert mhc and all(p.dtype == torch.float32 for p in mhc.values())
    zero = []
    for name, p in mhc.items():
        g = p.main_grad
        assert torch.isfinite(g).all(), name
        model_name = (
            name[name.index("decoder.") :] if "decoder." in name else name
        )  # without the wrappers' prefixes
        if (
            not _structurally_zero(model_name, config.mhc_num_residual_streams, config.num_layers)
            and not g.abs().sum() > 0
        ):
            zero.append(name)
    assert not zero, f"zero main_grad: {zero}"


def _dev_bf16_step(make_config, build_gpt, batch, distributed: bool):
    """megatron_dev in bf16 through DDP and one step of megatron-core's bf16 optimizer (`distributed`: the
    distributed one): `(the optimizer's parts, {name: mHC param}, names of the mHC params the step moved)`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config, model = _bf16_model(make_config, build_gpt, "megatron_dev", True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if _is_mhc(n)}
    ddp = _ddp_forward_backward(config, model, batch, distributed=distributed)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            bf16=True,
            params_dtype=torch.bfloat16,
            clip_grad=1.0,
            use_distributed_optimizer=distributed,
        ),
        [ddp],
    )
    ok, _, _ = opt.step()
    assert ok, "optimizer step reported failure (non-finite gradients)"
    params = {n: p for n, p in ddp.named_parameters() if _is_mhc(n)}
    moved = [n for n, p in params.items() if not torch.equal(p, before[n.removeprefix("module.")])]
    # get_megatron_optimizer returns a ChainedOptimizer (0.16.1 and 0.19.2): its parts hold the groups.
    return getattr(opt, "chained_optimizers", [opt]), params, moved


def test_dev_bf16_optimizer_routes_mhc_params_as_fp32(make_config, build_gpt, batch):
    """megatron_dev in bf16: the bf16 optimizer keeps the mHC params in its fp32 group, steps them, and they stay fp32."""
    parts, params, moved = _dev_bf16_step(make_config, build_gpt, batch, distributed=False)
    routed = {id(p) for part in parts for g in part.fp32_from_fp32_groups for p in g}
    assert routed, f"no fp32_from_fp32_groups in {[type(o).__name__ for o in parts]}"
    assert all(id(p) in routed and p.dtype == torch.float32 for p in params.values())
    assert any("mapping_proj" in n for n in moved), moved


def test_dev_bf16_distributed_optimizer_keeps_mhc_params_fp32(make_config, build_gpt, batch):
    """megatron_dev in bf16 under the distributed optimizer: the mHC params' shards are in its fp32 groups (no
    fp32 copy of a bf16 param), the bf16 params' in its fp32-from-bf16 groups; a step moves the mapping, and every
    mHC param stays fp32."""
    parts, params, moved = _dev_bf16_step(make_config, build_gpt, batch, distributed=True)
    assert all(type(o).__name__ == "DistributedOptimizer" for o in parts), [type(o).__name__ for o in parts]
    fp32_model = {id(p) for o in parts for g in o.model_fp32_groups for p in g}
    bf16_model = {id(p) for o in parts for g in o.model_float16_groups for p in g}
    assert all(id(p) in fp32_model and p.dtype == torch.float32 for p in params.values())
    assert bf16_model and not bf16_model & {id(p) for p in params.values()}
    assert any("mapping_proj" in n for n in moved), moved


def _misplaced(part) -> list[str]:
    """Model parameters of a `DistributedOptimizer` part whose `_get_main_param_and_optimizer_states` main copy is
    not theirs (another size, or values that do not round to theirs)."""
    wrong = []
    for group in [*part.model_fp32_groups, *part.model_float16_groups]:
        for p in group:
            main = part._get_main_param_and_optimizer_states(p)["param"]
            if main.numel() != p.numel() or not torch.equal(main.to(p.dtype), p.detach().view(-1)):
                wrong.append(f"{list(p.shape)} {p.dtype}: main {list(main.shape)}")
    return wrong


def test_dev_bf16_distributed_optimizer_maps_each_param_to_its_state(make_config, build_gpt, batch):
    """megatron-core's distributed optimizer maps a group mixing fp32-kept and bf16 params to the wrong main copies
    (the finding); after `align_param_group_index_map` every param's main copy and Adam state are its own."""
    from mhc_core.megatron.distrib_optimizer import align_param_group_index_map

    parts, _, _ = _dev_bf16_step(make_config, build_gpt, batch, distributed=True)
    before = [w for part in parts for w in _misplaced(part)]
    moved = sum(align_param_group_index_map(part) for part in parts)
    after = [w for part in parts for w in _misplaced(part)]
    assert not after, f"after the mend: {after}"
    assert moved > 0 and before, "megatron-core no longer misplaces them: the mend can go (update the docs)"
    assert align_param_group_index_map(parts[0]) == 0  # idempotent
