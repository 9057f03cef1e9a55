"""`python -m mhc_core.kernels`: the preflight says where each op runs, and agrees with the dispatch."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mhc_core import ops
from mhc_core.kernels import dispatch, preflight
from mhc_core.kernels.cutile import tuning

COMPILED_OK, COMPILED_WHY = dispatch.availability("compiled", "cpu")
needs_compiled = pytest.mark.skipif(not COMPILED_OK, reason=COMPILED_WHY)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No MHC_BACKEND* / MHC_CUTILE_TUNING from the caller's environment, fresh dispatch caches."""
    import os

    for var in [tuning.ENV, *(k for k in os.environ if k.startswith(dispatch.ENV_ALL))]:
        monkeypatch.delenv(var, raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


@needs_compiled
def test_cpu_runs_every_op_on_compiled(capsys):
    """On CPU tensors without overrides every op runs on `compiled`, chosen by auto; exit 0."""
    rc = preflight.main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for op in dispatch.OPS:
        assert f"{op}" in out and "compiled (auto)" in out.split(op, 1)[1].splitlines()[0]
    assert "cutile     unavailable: cutile runs on CUDA tensors only" in out


@needs_compiled
@pytest.mark.parametrize(
    ("n", "dropout", "uncovered"),
    [
        (3, 0.0, set(dispatch.OPS)),
        (4, 0.1, {"h_post_bda"}),
        (4, 0.0, set()),
    ],
    ids=["n3", "n4-dropout", "n4"],
)
def test_prediction_matches_the_dispatch(cutile_on_cpu, caplog, n, dropout, uncovered):
    """Under auto with cuTile available, the ops cuTile does not cover (n = 3: none; dropout in
    training: h_post_bda) are predicted on `compiled`, and a real dispatched call runs there."""
    report = preflight.preflight(device="cpu", n=n, dtype="fp32", dropout=dropout)
    assert report.ok, report.problems
    runs_on = {p.op: p.runs_on for p in report.ops}
    assert runs_on == {op: "compiled" if op in uncovered else "cutile" for op in dispatch.OPS}
    assert all(p.backend == "cutile" and p.set_by is None for p in report.ops)
    gen = torch.Generator().manual_seed(5)
    t, c = 8, 64
    x, h_pre = torch.randn(t, n, c, generator=gen), torch.rand(t, n, generator=gen)
    h_res, h_post = torch.rand(t, n, n, generator=gen), torch.rand(t, n, generator=gen)
    y, bias = torch.randn(t, c, generator=gen), torch.randn(c, generator=gen)
    with caplog.at_level(logging.INFO, logger="mhc_core.kernels"):
        ops.h_aggregate(x, h_pre, backend=dispatch.DISPATCH)
        ops.h_post_bda(h_res, x, h_post, y, bias, dropout, True, backend=dispatch.DISPATCH)
    logged = [r.getMessage() for r in caplog.records if r.name == "mhc_core.kernels"]
    for op in ("h_aggregate", "h_post_bda"):
        # the backend the call ended on is the last one logged for the op
        last = [m for m in logged if m.startswith(f"mHC op {op} uses backend")][-1]
        assert last.startswith(f"mHC op {op} uses backend {runs_on[op]} "), (op, logged)
    if uncovered:
        p = next(p for p in report.ops if p.op in uncovered)
        assert "does not cover this run" in p.why and (
            f"n={n}" in p.why or f"dropout_p={dropout}" in p.why
        ), p.why


def test_forced_cutile_that_does_not_cover_the_run_is_a_problem(cutile_on_cpu, capsys, monkeypatch):
    """MHC_BACKEND_MAPPING=cutile at n = 3: its first call would raise, so exit 1 naming the variable and n."""
    monkeypatch.setenv("MHC_BACKEND_MAPPING", "cutile")
    rc = preflight.main(["--device", "cpu", "--n", "3"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "PROBLEM: mapping: MHC_BACKEND_MAPPING forces cutile, but cutile mapping: n=3" in out, out


def test_forced_unavailable_and_invalid_values_are_problems(capsys, monkeypatch):
    """A forced backend that is unavailable, and an invalid value, each name their variable; exit 1."""
    monkeypatch.setenv("MHC_BACKEND_H_AGGREGATE", "cutile")
    monkeypatch.setenv("MHC_BACKEND_SINKHORN", "fast")
    rc = preflight.main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "PROBLEM: sinkhorn: MHC_BACKEND_SINKHORN='fast' is not a valid mHC backend" in out, out
    assert (
        "PROBLEM: h_aggregate: mhc_core.kernels: op 'h_aggregate' is forced to backend 'cutile' by "
        "MHC_BACKEND_H_AGGREGATE='cutile'" in out
    ), out
    assert "environment: MHC_BACKEND_H_AGGREGATE=cutile, MHC_BACKEND_SINKHORN=fast" in out


def test_cutile_tuning_is_named_and_a_bad_file_is_a_problem(tmp_path, capsys, monkeypatch):
    """The tuning for --gpu-name is reported by file name; a missing MHC_CUTILE_TUNING file is exit 1 naming it."""
    good = tmp_path / "my_gpu.json"
    tuning.save(tuning.Tuning(device="My GPU", n=4, tiles={}, occupancy={"h_aggregate_fwd_kernel": 2}), good)
    monkeypatch.setenv(tuning.ENV, str(good))
    assert preflight.main(["--device", "cpu", "--gpu-name", "My GPU"]) == 0
    out = capsys.readouterr().out
    assert "cuTile tuning for My GPU: my_gpu.json sha256:" in out, out
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "absent.json"))
    assert preflight.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM: cuTile tuning {tmp_path / 'absent.json'}: cannot read it" in out, out


def test_json_report(capsys):
    """--json prints every op with its backend and ok flag, and the overall ok."""
    assert preflight.main(["--device", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["device"] == "cpu"
    assert [o["op"] for o in doc["ops"]] == list(dispatch.OPS)
    assert all(o["ok"] and o["runs_on"] == o["backend"] for o in doc["ops"])
    assert set(doc["backends"]) == set(dispatch.BACKENDS)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--n", "0"], "n=0 residual streams: must be >= 1"),
        (["--dropout", "1.5"], "dropout=1.5: must be in [0, 1)"),
        (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    ],
    ids=["n0", "dropout", "dtype"],
)
def test_bad_arguments_exit_2(argv, named, capsys):
    """n < 1, a dropout outside [0, 1) and an unknown dtype are usage errors naming the value."""
    with pytest.raises(SystemExit) as exc:
        preflight.main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_misspelt_backend_variable_is_a_problem(capsys, monkeypatch):
    """MHC_BACKEND_AGGREGATE (the dispatch reads MHC_BACKEND_H_AGGREGATE) is named with the likely intent; exit 1."""
    monkeypatch.setenv("MHC_BACKEND_AGGREGATE", "reference")
    assert preflight.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert (
        "PROBLEM: MHC_BACKEND_AGGREGATE is not a variable the dispatch reads (it is ignored); "
        "did you mean MHC_BACKEND_H_AGGREGATE?"
    ) in out, out


def test_cuda_without_a_gpu_says_so(capsys, monkeypatch):
    """--device cuda on a machine without CUDA adds a note that only the dispatch's choices are described."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preflight.main(["--device", "cuda"])
    assert "note: no CUDA device on this machine" in capsys.readouterr().out


def test_fp32_sinkhorn_logits_of_paper_stay_on_cutile(cutile_on_cpu):
    """fp16 activations have no cuTile kernel, but `paper` hands fp32 coefficients: only its sinkhorn stays on
    cuTile; under megatron_main and megatron_dev (logits in the activation dtype) it moves too."""
    plans = {
        v: {p.op: p.runs_on for p in preflight.preflight(device="cpu", dtype="fp16", variant=v).ops}
        for v in ("paper", "megatron_main", "megatron_dev")
    }
    assert [plans[v]["sinkhorn"] == "cutile" for v in plans] == [True, False, False], plans
    assert all(plans[v][op] != "cutile" for v in plans for op in ("mapping", "h_aggregate", "h_post_bda")), (
        plans
    )


def test_preflight_says_where_pres_forward_runs(monkeypatch):
    """On CPU the report says whether pre's compiled forward and backward are the native kernels, and why not where
    they are not."""
    from mhc_core.kernels import native

    for name in [dispatch.ENV_ALL, *(dispatch.env_var(op) for op in dispatch.OPS)]:
        monkeypatch.delenv(name, raising=False)
    notes = " ".join(preflight.preflight(device="cpu", dtype="fp16", variant="megatron_main").notes)
    why = "the native kernel reads no fp16 activations" if native.available()[0] else native.available()[1]
    assert f"pre's forward runs its torch.compile graph ({why}" in notes
    monkeypatch.setenv(native.ENV, "0")
    notes = " ".join(preflight.preflight(device="cpu", dtype="fp32").notes)
    assert "pre's forward runs its torch.compile graph (turned off (MHC_NATIVE=0)" in notes
    monkeypatch.delenv(native.ENV)
    if native.available()[0]:
        notes = " ".join(preflight.preflight(device="cpu", dtype="bf16", variant="megatron_dev").notes)
        assert (
            "pre's forward runs its native kernel (the mapping computes in fp32), its backward the native "
            "kernel's passes over x"
        ) in notes
        for kernel in ("avx512_bf16", "avx512"):  # bf16 dot products, or fp32 FMAs and the bf16 GEMMs
            if kernel not in native.kernels():
                continue
            monkeypatch.setenv(native.ENV, kernel)
            notes = " ".join(preflight.preflight(device="cpu", dtype="bf16", variant="megatron_main").notes)
            backward = (
                "the native kernel's passes over x"
                if kernel == "avx512_bf16"
                else "its torch.compile graph (bf16 GEMMs)"
            )
            assert (
                f"pre's forward runs its native kernel (the mapping computes in bf16), its backward {backward}"
                in notes
            )
