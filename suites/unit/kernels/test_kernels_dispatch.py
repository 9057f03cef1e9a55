"""The per-op dispatch: environment overrides, clear errors, logging once, and the module on top."""

from __future__ import annotations

import logging

import pytest
import torch

from mhc_core import HyperConnectionConfig, HyperConnectionModule, ops
from mhc_core.kernels import DISPATCH, BackendUnavailableError, dispatch, select_backend
from mhc_core.ops import REFERENCE
from mhc_core.ops.contract import ReferenceBackend
from mhc_core.variants import Variant
from suites.unit.kernels.parity import C, device_for, run_fwd_bwd

COMPILED_OK, COMPILED_WHY = dispatch.availability("compiled", "cpu")
needs_compiled = pytest.mark.skipif(not COMPILED_OK, reason=COMPILED_WHY)
# The compiled backend's own behaviour (T = 0, dynamic T, the module on top) is checked where its
# parity tests run: the GPU when there is one, else the CPU.
DEV = device_for("compiled")
DEV_OK, DEV_WHY = dispatch.availability("compiled", DEV)
needs_compiled_dev = pytest.mark.skipif(not DEV_OK, reason=DEV_WHY)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No MHC_BACKEND* from the caller's environment, and fresh caches, in every test."""
    for var in [dispatch.ENV_ALL, *(dispatch.env_var(op) for op in dispatch.OPS)]:
        monkeypatch.delenv(var, raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


def _agg_inputs(t: int = 8, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(t, n, C, generator=gen), torch.rand(t, n, generator=gen)


def test_env_var_names():
    """Per-op variables are MHC_BACKEND_<OP>."""
    assert [dispatch.env_var(op) for op in dispatch.OPS] == [
        "MHC_BACKEND_SINKHORN",
        "MHC_BACKEND_MAPPING",
        "MHC_BACKEND_H_AGGREGATE",
        "MHC_BACKEND_H_POST_BDA",
        "MHC_BACKEND_PRE",
    ]


@needs_compiled
def test_auto_on_cpu_is_compiled():
    """Without overrides on a CPU tensor, every op resolves to `compiled` (cutile needs CUDA)."""
    assert {op: dispatch.resolve_backend(op, "cpu") for op in dispatch.OPS} == dict.fromkeys(
        dispatch.OPS, "compiled"
    )


def test_per_op_override_wins_over_global(monkeypatch):
    """MHC_BACKEND_SINKHORN=auto beats MHC_BACKEND=reference for sinkhorn only."""
    monkeypatch.setenv("MHC_BACKEND", "reference")
    monkeypatch.setenv("MHC_BACKEND_SINKHORN", "auto")
    monkeypatch.setattr(dispatch, "availability", lambda backend, device=None: (backend != "cutile", "stub"))
    got = {op: dispatch.resolve_backend(op, "cpu") for op in dispatch.OPS}
    assert got == {
        "sinkhorn": "compiled",
        "mapping": "reference",
        "h_aggregate": "reference",
        "h_post_bda": "reference",
        "pre": "reference",
    }


def test_values_are_case_and_space_insensitive(monkeypatch):
    """` Reference ` selects the reference."""
    monkeypatch.setenv("MHC_BACKEND_H_AGGREGATE", " Reference ")
    assert dispatch.resolve_backend("h_aggregate", "cpu") == "reference"


def test_invalid_value_names_the_variable(monkeypatch):
    """A bad value is a ValueError naming the variable, the value and the valid choices."""
    monkeypatch.setenv("MHC_BACKEND_MAPPING", "triton")
    with pytest.raises(ValueError, match=r"MHC_BACKEND_MAPPING='triton'.*auto, reference, compiled, cutile"):
        dispatch.resolve_backend("mapping", "cpu")


def test_unknown_op_is_a_value_error():
    """resolve_backend of an unknown op names the valid ops."""
    with pytest.raises(ValueError, match="sinkhorn, mapping, h_aggregate, h_post_bda"):
        dispatch.resolve_backend("softmax")


def test_forced_cutile_on_cpu_raises(monkeypatch):
    """MHC_BACKEND=cutile on CPU tensors raises, naming the op, the backend, the variable and the reason."""
    monkeypatch.setenv("MHC_BACKEND", "cutile")
    x, h = _agg_inputs()
    with pytest.raises(BackendUnavailableError, match=r"'h_aggregate'.*'cutile'.*MHC_BACKEND='cutile'.*CUDA"):
        ops.h_aggregate(x, h, backend=DISPATCH)


def test_forced_unavailable_compiled_raises(monkeypatch):
    """A forced `compiled` without a working torch.compile raises with the probe's reason, no fallback."""
    monkeypatch.setenv("MHC_BACKEND_SINKHORN", "compiled")
    monkeypatch.setitem(dispatch._AVAILABILITY, ("compiled", "cpu"), (False, "no C++ compiler (stub)"))
    with pytest.raises(BackendUnavailableError, match=r"'sinkhorn'.*'compiled'.*no C\+\+ compiler \(stub\)"):
        ops.sinkhorn(torch.zeros(2, 3, 3), 2, backend=DISPATCH)


def test_select_backend_fails_early_for_forced_unavailable(monkeypatch):
    """select_backend(True) checks the selection up front: a module cannot be built on a forced unavailable
    backend."""
    monkeypatch.setenv("MHC_BACKEND_H_POST_BDA", "cutile")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="'h_post_bda'"):
        select_backend(True)


def test_select_backend():
    """use_fused=False keeps the reference backend; use_fused=True returns the dispatch."""
    assert select_backend(False) is REFERENCE
    assert select_backend(True) is DISPATCH


def test_backend_report_covers_every_op_and_never_raises(monkeypatch):
    """backend_report names a backend and a reason per op; a forced unavailable one is reported as such."""
    monkeypatch.setenv("MHC_BACKEND_MAPPING", "cutile")
    monkeypatch.setenv("MHC_BACKEND_SINKHORN", "reference")
    report = dispatch.backend_report("cpu")
    assert set(report) == set(dispatch.OPS)
    assert report["sinkhorn"][0] == "reference" and "MHC_BACKEND_SINKHORN" in report["sinkhorn"][1]
    assert report["mapping"][0] == "cutile" and report["mapping"][1].startswith("unavailable:")
    assert all(isinstance(why, str) and why for _, why in report.values())


def test_choice_is_logged_once_per_op_and_backend(monkeypatch, caplog):
    """Repeated calls log the (op, backend) choice once; a new backend for the op logs again."""
    monkeypatch.setenv("MHC_BACKEND", "reference")
    x, h = _agg_inputs()
    with caplog.at_level(logging.INFO, logger="mhc_core.kernels"):
        for _ in range(3):
            ops.h_aggregate(x, h, backend=DISPATCH)
        ops.sinkhorn(torch.zeros(2, 3, 3), 2, backend=DISPATCH)
        monkeypatch.setattr(dispatch, "get_backend", lambda backend: REFERENCE)
        monkeypatch.setattr(dispatch, "availability", lambda backend, device=None: (True, "stub"))
        monkeypatch.setenv("MHC_BACKEND_H_AGGREGATE", "compiled")
        ops.h_aggregate(x, h, backend=DISPATCH)
        ops.h_aggregate(x, h, backend=DISPATCH)
    lines = [r.getMessage() for r in caplog.records if r.name == "mhc_core.kernels"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("mHC op h_aggregate uses backend reference")
    assert lines[1].startswith("mHC op sinkhorn uses backend reference")
    assert lines[2].startswith("mHC op h_aggregate uses backend compiled")


def test_auto_moves_on_when_cutile_does_not_cover_a_call(monkeypatch, caplog):
    """Under auto, a cutile NotImplementedError sends the call to the next backend, logged; forced, it propagates."""

    class Refusing(ReferenceBackend):  # the reference, but an aggregate cuTile would not cover
        name = "cutile"

        def h_aggregate(self, call):
            raise NotImplementedError("n=3 has no kernel")

    impls = {"cutile": Refusing(), "compiled": REFERENCE, "reference": REFERENCE}
    monkeypatch.setattr(dispatch, "availability", lambda backend, device=None: (True, f"{backend} stub"))
    monkeypatch.setattr(dispatch, "get_backend", lambda backend: impls[backend])
    x, h = _agg_inputs(n=3)
    with caplog.at_level(logging.INFO, logger="mhc_core.kernels"):
        out = ops.h_aggregate(x, h, backend=DISPATCH)
    torch.testing.assert_close(out, ops.h_aggregate(x, h), rtol=0, atol=0)
    messages = [r.getMessage() for r in caplog.records if r.name == "mhc_core.kernels"]
    assert any("backend compiled" in m and "n=3 has no kernel" in m for m in messages), messages
    monkeypatch.setenv("MHC_BACKEND_H_AGGREGATE", "cutile")
    with pytest.raises(NotImplementedError, match="n=3"):
        ops.h_aggregate(x, h, backend=DISPATCH)


@needs_compiled_dev
@pytest.mark.parametrize("op", dispatch.OPS)
def test_compiled_empty_tokens(op):
    """T = 0 returns empty outputs of the reference's shapes and dtypes, and backward runs."""
    impl, ref = dispatch.op_on(op, "compiled"), getattr(ops, op)
    n = 4
    if op == "sinkhorn":
        inputs = {"logits": torch.zeros(0, n, n)}
    elif op == "mapping":
        k, big_n = n * C, n * n + 2 * n
        inputs = {
            "x": torch.zeros(0, k),
            "weight": torch.ones(big_n, k),
            "alpha_pre": torch.ones(1),
            "alpha_post": torch.ones(1),
            "alpha_res": torch.ones(1),
            "bias": torch.zeros(big_n),
        }
    elif op == "h_aggregate":
        inputs = {"x": torch.zeros(0, n, C), "h_pre": torch.zeros(0, n)}
    elif op == "pre":
        k, big_n = n * C, n * n + 2 * n
        inputs = {
            "x": torch.zeros(0, k),
            "weight": torch.ones(big_n, k),
            "alpha_pre": torch.ones(1),
            "alpha_post": torch.ones(1),
            "alpha_res": torch.ones(1),
            "bias": torch.zeros(big_n),
        }
    else:
        inputs = {
            "h_res": torch.zeros(0, n, n),
            "residual": torch.zeros(0, n, C),
            "h_post": torch.zeros(0, n),
            "y": torch.zeros(0, C),
            "bias": torch.zeros(C),
        }
    inputs = {k: v.to(DEV) for k, v in inputs.items()}
    kwargs = {"n": n} if op in ("mapping", "pre") else {}
    got, got_grads = run_fwd_bwd(impl, inputs, list(inputs), **kwargs)
    want, want_grads = run_fwd_bwd(ref, inputs, list(inputs), **kwargs)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    for k, g in want_grads.items():
        assert (got_grads[k] is None) == (g is None) and (g is None or got_grads[k].shape == g.shape), k


@needs_compiled_dev
def test_compiled_token_count_does_not_recompile():
    """After T = 48 and T = 16, further token counts reuse the same compiled graph (dynamic token dim)."""
    from torch._dynamo.utils import counters

    impl = dispatch.op_on("h_aggregate", "compiled")
    gen = torch.Generator().manual_seed(5)
    for t in (48, 16):
        impl(torch.randn(t, 4, C, generator=gen).to(DEV), torch.rand(t, 4, generator=gen).to(DEV))
    before = counters["stats"]["unique_graphs"]
    for t in (17, 40, 100, 333):
        impl(torch.randn(t, 4, C, generator=gen).to(DEV), torch.rand(t, 4, generator=gen).to(DEV))
    assert counters["stats"]["unique_graphs"] == before, "a new token count triggered a recompile"


@needs_compiled_dev
@pytest.mark.parametrize("variant", [Variant.MEGATRON_DEV], ids=str)
def test_module_fused_matches_reference(variant, monkeypatch):
    """HyperConnectionModule with use_fused=True (compiled) matches use_fused=False on `DEV`: outputs and all grads.
    In DeepSeek-V4's variant: the module's routing is the same for every variant, whose ops' numerics the parity
    tests check each (the other two variants here cost CI 70 s of cold compilation)."""
    monkeypatch.setenv("MHC_BACKEND", "compiled")
    from suites.unit.kernels.test_kernels_parity_sinkhorn import ITERATIONS

    torch.manual_seed(0)
    kwargs = {
        "hidden_size": C,
        "num_residual_streams": 4,
        "variant": variant,
        "sinkhorn_iterations": ITERATIONS,
        "init_gating_factor": 0.5,
    }
    ref_mod = HyperConnectionModule(HyperConnectionConfig(**kwargs, use_fused=False)).to(DEV)
    fused_mod = HyperConnectionModule(HyperConnectionConfig(**kwargs, use_fused=True)).to(DEV)
    fused_mod.load_state_dict(ref_mod.state_dict())
    with torch.no_grad():
        for mod in (ref_mod, fused_mod):
            mod.bias.copy_(torch.linspace(-0.5, 0.5, mod.bias.numel()))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, 4 * C, generator=gen).to(DEV)
    y, bias = torch.randn(6, 8, C, generator=gen).to(DEV), torch.randn(C, generator=gen).to(DEV)
    results = []
    for mod in (ref_mod, fused_mod):
        xi = x.clone().requires_grad_(True)
        agg, h_res, h_post, residual = mod(xi)
        out = mod.post_residual_bda(h_res, residual, h_post, (y + agg, bias))
        loss = (out * torch.cos(torch.arange(out.numel(), device=DEV).view_as(out).float())).sum()
        params = list(mod.parameters())
        grads = torch.autograd.grad(loss, [xi, *params])
        results.append((out.detach(), agg.detach(), grads))
    (out_r, agg_r, grads_r), (out_f, agg_f, grads_f) = results
    from mhc_core.testing import assert_close, tolerance

    assert_close("module output", out_f, out_r, tolerance(torch.float32, "fwd"))
    assert_close("module aggregated", agg_f, agg_r, tolerance(torch.float32, "fwd"))
    names = ["x", *(name for name, _ in ref_mod.named_parameters())]
    for name, a, e in zip(names, grads_f, grads_r, strict=True):
        assert_close(f"module grad {name}", a, e, tolerance(torch.float32, "bwd"))


@needs_compiled_dev
def test_single_pass_module_fused_matches_reference(monkeypatch):
    """The single-pass call (DeepSeek-V4.1's `deepseek_v41`: fp32 coefficients beside bf16 streams) with
    use_fused=True (compiled mapping, Sinkhorn and aggregate) matches the reference: branch input, next H_pre, the
    update, and the gradients of the streams, the previous H_pre and every parameter. (bf16 only, 4 Sinkhorn
    iterations: its compiles are the fp32 ones' plus the casts.)"""
    from suites.unit.kernels.test_kernels_parity_sinkhorn import ITERATIONS

    dtype = torch.bfloat16
    monkeypatch.setenv("MHC_BACKEND", "compiled")
    from mhc_core.testing import assert_close, tolerance

    kwargs = {
        "hidden_size": C,
        "num_residual_streams": 4,
        "variant": "deepseek_v41",
        "norm_eps": 1e-5,
        "form": "single_pass",
        "init_gating_factor": 0.5,
        "sinkhorn_iterations": ITERATIONS,  # the compiled Sinkhorn unrolls them: 20 cost ~40 s of cold compilation
    }
    ref_mod = HyperConnectionModule(HyperConnectionConfig(**kwargs, use_fused=False)).to(DEV)
    fused_mod = HyperConnectionModule(HyperConnectionConfig(**kwargs, use_fused=True)).to(DEV)
    with torch.no_grad():
        ref_mod.bias.copy_(torch.linspace(-0.5, 0.5, ref_mod.bias.numel()))
    fused_mod.load_state_dict(ref_mod.state_dict())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 8, 4 * C, generator=gen).to(DEV, dtype)
    prev = torch.rand(6, 8, 4, generator=gen).to(DEV)
    y = torch.randn(6, 8, C, generator=gen).to(DEV, dtype)
    results = []
    for mod in (ref_mod, fused_mod):
        xi, pi = x.clone().requires_grad_(True), prev.clone().requires_grad_(True)
        branch, h_res, h_post, nxt = mod(xi, previous_h_pre=pi)
        out = mod.post_residual_bda(h_res, xi, h_post, (y + branch, None))
        loss = (out.float() * torch.cos(torch.arange(out.numel(), device=DEV).view_as(out).float())).sum() + (
            nxt * torch.linspace(1, 2, 4, device=DEV)
        ).sum()
        grads = torch.autograd.grad(loss, [xi, pi, *mod.parameters()])
        results.append(((out.detach(), branch.detach(), nxt.detach()), grads))
    (outs_r, grads_r), (outs_f, grads_f) = results
    for name, a, e in zip(("update", "branch input", "next h_pre"), outs_f, outs_r, strict=True):
        assert_close(f"single-pass {name}", a, e, tolerance(a.dtype, "fwd"))
    names = ["x", "previous_h_pre", *(name for name, _ in ref_mod.named_parameters())]
    for name, a, e in zip(names, grads_f, grads_r, strict=True):
        assert_close(f"single-pass grad {name}", a, e, tolerance(a.dtype, "bwd"))
