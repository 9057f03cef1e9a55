"""Tuned tiles: the tuning file, its place between overrides and heuristics, and adopting a sweep's winners."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mhc_core import ops as ref
from mhc_core.kernels.cutile import CuTileBackend, tiling, tuning
from mhc_core.kernels.dispatch import bound_ops
from tools.cutile import adopt, signatures
from tools.cutile.emulator import EmulatedRuntime
from tools.cutile.sweep import CANDIDATES, CHECK_RTOL, deviation, main, override, regrade
from tools.cutile.sweep_check import SINKHORN_RTOL, check_rtol, grade

_S = tiling.StreamTiles
MMA_FWD = _S(8, 256, mma=True)  # a sweep candidate of h_aggregate_fwd, not the default


def _tuning(**kw) -> tuning.Tuning:
    base = dict(
        device="NVIDIA H200",
        n=4,
        tiles={"h_aggregate_fwd": MMA_FWD, "sinkhorn": tiling.SinkhornTiles(128)},
        occupancy={"h_post_bda_bwd_kernel": 4},
    )
    return tuning.Tuning(**{**base, **kw})


def test_file_round_trip(tmp_path):
    """A saved tuning loads back equal, with every tile type and the occupancy hints."""
    t = _tuning(
        tiles={
            "h_aggregate_fwd": MMA_FWD,
            "sinkhorn": tiling.SinkhornTiles(128, per_element=True),
            "mapping_bwd": tiling.MappingTiles(16, 64),
            "h_post_bda_bwd": _S(8, 64, per_stream=tiling.StreamLayout.TUPLE),
        }
    )
    path = tmp_path / "t.json"
    tuning.save(t, path)
    back = tuning.load(path)
    assert back == t and back.source == str(path)
    raw = json.loads(path.read_text())["tiles"]
    assert raw["mapping_bwd"] == {"MappingTiles": {"tile_m": 16, "tile_k": 64}}
    assert raw["h_post_bda_bwd"]["StreamTiles"]["per_stream"] == 2  # a StreamLayout is written as its number


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"schema": 2, "device": "x", "n": 4, "tiles": {}}', "schema 2"),
        ('{"schema": 1, "device": "x", "tiles": {}}', "missing n"),
        ('{"schema": 1, "device": "x", "n": 3, "tiles": {}}', "n=3"),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": [], "occupancy": [1]}',
            "tiles, occupancy must be JSON objects",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {"h_aggregate_fwd": {"StreamTiles": {"tile_t": 8, "tile_c": 96}}}}',
            "powers of two",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {"sinkhorn": {"StreamTiles": {"tile_t": 8, "tile_c": 64}}}}',
            "expected a SinkhornTiles",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {"no_key": {"StreamTiles": {"tile_t": 8, "tile_c": 64}}}}',
            "unknown key 'no_key'",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {"h_aggregate_fwd": {"StreamTiles": {"tile_t": 8, "tile_c": 64, '
            '"tile_x": 1}}}}',
            "no field",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {"h_aggregate_fwd": {"Tiles": {}}}}',
            "expected {type: fields}",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {"h_aggregate_fwd": {"StreamTiles": [8, 256]}}}',
            "expected {type: fields}",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {}, "occupancy": {"h_aggregate_fwd_kernel": 64}}',
            "must be an integer in 1-32",
        ),
        (
            '{"schema": 1, "device": "x", "n": 4, "tiles": {}, "occupancy": {"bogus_kernel": 2}}',
            r"occupancy names unknown kernels \['bogus_kernel'\]; valid: h_aggregate_bwd_h_kernel",
        ),
        ('{"schema": 1, "device": "x", "n": "4", "tiles": {}}', r"n='4' must be an integer"),
    ],
)
def test_malformed_file_is_named(tmp_path, content, match):
    """A missing, non-JSON or invalid tuning file raises `ValueError` naming the file and the entry."""
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        tuning.load(path)
    assert str(path) in str(info.value)


def test_tuning_sits_between_overrides_and_heuristics():
    """Under a tuning its tiles and hints are the defaults at its n (stream tiles where TILE_C fits C);
    `overridden` still wins; other n and small C keep the heuristics; the block restores them."""
    default, default_n2 = tiling.aggregate_tiles(4, 4096, "fwd"), tiling.aggregate_tiles(2, 4096, "fwd")
    assert default != MMA_FWD
    with tiling.tuned(_tuning()):
        assert tiling.aggregate_tiles(4, 4096, "fwd") == MMA_FWD
        assert tiling.aggregate_tiles(4, 256, "fwd") == MMA_FWD
        assert tiling.aggregate_tiles(4, 64, "fwd") == _S(
            tile_t=32, tile_c=64, per_stream=tiling.StreamLayout.SLICES
        )  # TILE_C 256 > 64
        assert tiling.aggregate_tiles(2, 4096, "fwd") == default_n2  # another n: heuristic
        assert tiling.aggregate_tiles(4, 4096, "bwd") == tiling.StreamTiles(8, 256)  # not tuned: heuristic
        assert tiling.sinkhorn_tile(4) == tiling.SinkhornTiles(128) and tiling.sinkhorn_tile(8).tile_b == 16
        assert (
            tiling.occupancy("h_post_bda_bwd_kernel") == 4
            and tiling.occupancy("h_aggregate_fwd_kernel") is None
        )
        with tiling.overridden(
            h_aggregate_fwd=_S(2, 512, per_stream=tiling.StreamLayout.SLICES), occupancy={}
        ):
            assert tiling.aggregate_tiles(4, 4096, "fwd") == _S(2, 512, per_stream=tiling.StreamLayout.SLICES)
            assert tiling.occupancy("h_post_bda_bwd_kernel") is None
    assert tiling.aggregate_tiles(4, 4096, "fwd") == default and tiling.active_tuning() is None


def test_resolve_env_then_shipped_file(tmp_path, monkeypatch):
    """`MHC_CUTILE_TUNING` names a file or `off`; unset, the file shipped for the device name decides."""
    shipped = tmp_path / "tuned"
    shipped.mkdir()
    monkeypatch.setattr(tuning, "TUNED_DIR", shipped)
    monkeypatch.delenv(tuning.ENV, raising=False)
    assert tuning.resolve("NVIDIA H200") is None and tuning.resolve(None) is None
    tuning.save(_tuning(), shipped / "nvidia_h200.json")
    assert tuning.device_slug("NVIDIA H200") == "nvidia_h200"
    assert tuning.resolve("NVIDIA H200") == _tuning()
    assert tuning.resolve("NVIDIA H100 80GB HBM3") is None and tuning.resolve(None) is None
    other = tmp_path / "mine.json"
    tuning.save(_tuning(tiles={}), other)
    monkeypatch.setenv(tuning.ENV, str(other))
    assert tuning.resolve("NVIDIA H200").tiles == {} and tuning.resolve(None).tiles == {}
    monkeypatch.setenv(tuning.ENV, "off")
    assert tuning.resolve("NVIDIA H200") is None
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json"):
        tuning.resolve("NVIDIA H200")
    line = tuning.describe(tuning.load(shipped / "nvidia_h200.json"))
    assert line.startswith(f"nvidia_h200.json sha256:{_tuning().digest()} (NVIDIA H200, n = 4")
    assert str(tmp_path) not in line  # records name the file and its content, not this machine's paths
    assert _tuning(tiles={}).digest() != _tuning().digest()
    assert tuning.describe(None).startswith("none")


def _row(key, cand, direction, ms, check="ok"):
    return {
        "key": key,
        "tiles": repr(cand),
        "direction": direction,
        "single_ms": ms,
        "pipelined_ms": ms * 2,
        "device_ms": ms,
        "gb_per_s": 1.0,
        "check": check,
        "max_rel_err": 1e-3 if check == "ok" else 0.9,
    }


def _sweep_doc(rows):
    """A sweep `--out` document (bf16, `megatron_dev`, NVIDIA H200) holding `rows`."""
    return {
        "tokens": 8192,
        "hidden": 4096,
        "n": 4,
        "dtype": "bf16",
        "variant": "megatron_dev",
        "device": "NVIDIA H200",
        "rows": rows,
    }


def _stale_sinkhorn_rows():
    """The fastest Sinkhorn candidate (`CANDIDATES["sinkhorn"][3]`), recorded "ok" under the bf16 bound
    with the H200's wrong per-element backward error (7.6e-3)."""
    cand = CANDIDATES["sinkhorn"][3]
    rows = [_row("sinkhorn", cand, "fwd", 0.001), _row("sinkhorn", cand, "bwd", 0.002)]
    rows[1]["max_rel_err"] = 7.6e-3
    return rows


def _sweep_rows():
    agg, pbwd, sk = CANDIDATES["h_aggregate_fwd"], CANDIDATES["h_post_bda_bwd"], CANDIDATES["sinkhorn"]
    occ = CANDIDATES["h_post_bda_bwd_occupancy"]
    return [
        _row("h_aggregate_fwd", agg[0], "fwd", 0.20),
        _row("h_aggregate_fwd", agg[1], "fwd", 0.15),
        _row("h_aggregate_fwd", agg[2], "fwd", 0.05, check="fail"),  # fastest, but wrong
        _row("h_post_bda_bwd", pbwd[0], "bwd", 1.00),
        _row("h_post_bda_bwd", pbwd[1], "bwd", 0.99),
        _row("h_post_bda_bwd_occupancy", occ[-1], "bwd", 0.50),
        _row("sinkhorn", sk[0], "fwd", 0.040),
        _row("sinkhorn", sk[0], "bwd", 0.160),
        _row("sinkhorn", sk[1], "fwd", 0.010),  # no backward timed: not comparable
        _row("sinkhorn", sk[2], "fwd", 0.050),
        _row("sinkhorn", sk[2], "bwd", 0.100),
        {"key": "mapping_bwd", "tiles": repr(CANDIDATES["mapping_bwd"][1]), "error": "TileCompilerError"},
        _row("mapping_fwd", CANDIDATES["mapping_fwd"][1], "fwd", 0.1),  # default not timed
    ]


def test_from_sweep_adopts_checked_winners():
    """Per tile key the fastest candidate that matched the reference, over the key and its occupancy key
    (Sinkhorn: fwd + bwd), is adopted when it beats the default by the minimum gain; else the heuristic stays."""
    data = _sweep_doc(_sweep_rows())
    t, lines = adopt.from_sweep(data, CANDIDATES, min_gain=1.03, source="t.json")
    occ_winner = CANDIDATES["h_post_bda_bwd_occupancy"][-1]
    assert t.tiles == {
        "h_aggregate_fwd": CANDIDATES["h_aggregate_fwd"][1],
        "h_post_bda_bwd": occ_winner["h_post_bda_bwd"],
        "sinkhorn": CANDIDATES["sinkhorn"][2],
    }
    assert t.occupancy == occ_winner["occupancy"]
    assert t.gains["sinkhorn"] == {
        "default_ms": 0.2,
        "ms": 0.15,
        "candidate": f"sinkhorn={CANDIDATES['sinkhorn'][2]!r}",
    }
    assert t.measured == {"tokens": 8192, "hidden": 4096, "dtype": "bf16", "variant": "megatron_dev"}
    text = "\n".join(lines)
    assert "mapping_fwd: default not timed" in text and "mapping_bwd: default not timed" in text
    t2, lines2 = adopt.from_sweep(data, CANDIDATES, min_gain=1.5)
    assert set(t2.tiles) == {"h_post_bda_bwd"}, lines2  # 1.33x (agg) and 1.33x (sinkhorn) are below 1.5
    with pytest.raises(ValueError, match="missing"):
        adopt.from_sweep({"rows": []}, CANDIDATES)


def test_a_fused_pre_that_wins_the_sweep_is_adopted_and_launched(tmp_path):
    """The pre-op's formulation is a sweep key: when the fused candidate wins forward + backward (here 1.5x),
    the tuning carries `pre: PreTiles(fused=True)` through its file, and under it the op launches the fused
    kernels; the default (the composition) launches the mapping's own."""
    composed, fused = CANDIDATES["pre"]
    assert (composed, fused) == (tiling.PreTiles(fused=False), tiling.PreTiles(fused=True))
    rows = [
        _row("pre", composed, "fwd", 0.30),
        _row("pre", composed, "bwd", 0.60),
        _row("pre", fused, "fwd", 0.20),
        _row("pre", fused, "bwd", 0.40),
    ]
    t, lines = adopt.from_sweep(_sweep_doc(rows), CANDIDATES, source="t.json")
    assert t.tiles == {"pre": fused}, lines
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_json()))
    loaded = tuning.load(path)
    assert loaded.tiles == {"pre": fused}

    def launched(tun):
        rt = EmulatedRuntime(num_sms=4)
        names = []
        launch = rt.launch

        def counted(grid, name, args):
            names.append(name)
            return launch(grid, name, args)

        rt.launch = counted  # this runtime object's launches, counted
        x = torch.randn(40, 4 * 256, requires_grad=True)
        w = (torch.randn(24, 4 * 256) * 0.05).requires_grad_(True)
        with tiling.tuned(tun):
            outs = bound_ops(CuTileBackend(rt)).pre(
                x, w, *(torch.full((1,), 0.5) for _ in range(3)), torch.zeros(24), 4, 3, "megatron_dev"
            )
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return set(names)

    assert {"h_aggregate_bwd_h_kernel", "pre_bwd_dx_dw_kernel"} <= launched(loaded)
    assert not {"h_aggregate_bwd_h_kernel", "pre_bwd_dx_dw_kernel"} & launched(None)
    with pytest.raises(ValueError, match="fused must be a bool"):
        tiling.check_tile("pre", tiling.PreTiles(fused=1))


def test_adopt_cli_writes_a_loadable_tuning(tmp_path, capsys):
    """`sweep --adopt SWEEP --out TUNING` writes the winners; the file loads and puts them in force."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_sweep_doc(_sweep_rows())))
    out = tmp_path / "tuning.json"
    assert main(["--adopt", str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "h_aggregate_fwd: adopted" in printed
    assert "ship it as mhc_core/kernels/cutile/tuned/nvidia_h200.json" in printed  # the sweep's device
    with tiling.tuned(tuning.load(out)):
        assert tiling.aggregate_tiles(4, 4096, "fwd") == CANDIDATES["h_aggregate_fwd"][1]
    assert main(["--adopt", str(sweep)]) == 2 and "--out" in capsys.readouterr().err
    assert main(["--adopt", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_tuned_plan_lists_the_tuned_launches():
    """The signature plan of a tuning holds its tiles' launches (CI compiles them), none of the default plan's."""
    plan = signatures.tuned_plan([_tuning()])
    assert plan and all(p.id.startswith("tuned-nvidia_h200-") for p in plan)
    assert {p.kernel_name for p in plan} == {
        "h_aggregate_fwd_kernel",
        "sinkhorn_fwd_kernel",
        "sinkhorn_bwd_kernel",
    }
    default = {(p.kernel_name, p.args) for p in signatures.signature_plan()}
    assert not default & {(p.kernel_name, p.args) for p in plan}
    assert signatures.tuned_plan([]) == ()


@pytest.fixture(scope="module")
def emu():
    return bound_ops(CuTileBackend(EmulatedRuntime(num_sms=4)))


CASES = [
    pytest.param(key, cand, id=f"{key}-{i}")
    for key, cands in CANDIDATES.items()
    for i, cand in enumerate(cands)
]


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(("key", "cand"), CASES)
def test_sweep_check_accepts_every_candidate(emu, key, cand):
    """Every sweep candidate passes the sweep's reference check (CPU kernel interpreter, bf16): the
    tolerance refuses wrong results, never a correct formulation."""
    torch.manual_seed(0)
    with tiling.overridden(**override(key, cand)):
        errs = deviation(emu, key, 40, 4, 512, torch.bfloat16, "megatron_dev", 3, device="cpu")
    assert errs and all(grade(key, torch.bfloat16, e) == "ok" for e in errs.values()), (key, cand, errs)


class _PairOff(torch.autograd.Function):
    """The reference Sinkhorn forward with the gradient of one iteration fewer (one normalisation pair
    fewer, for every variant): what a backward that walks back one pair off computes."""

    @staticmethod
    def forward(ctx, z, iterations, variant):
        ctx.save_for_backward(z)
        ctx.args = (iterations, variant)
        return ref.sinkhorn(z, iterations, None, variant)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        iterations, variant = ctx.args
        with torch.enable_grad():
            z = z.detach().requires_grad_(True)
            (gz,) = torch.autograd.grad(ref.sinkhorn(z, iterations - 1, None, variant), z, g)
        return gz, None, None


@pytest.mark.parametrize("variant", ["megatron_main", "megatron_dev"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sweep_check_refuses_a_sinkhorn_backward_a_pair_off(emu, variant, seed):
    """The sweep's Sinkhorn inputs are far enough from convergence that a backward one pair off in
    its walk back fails the Sinkhorn bound (1.9-2.2e-3 against 1e-3; at scale 1 it was ~2e-5),
    forward untouched."""
    off = dataclasses.replace(emu, sinkhorn=lambda z, it, eps, v: _PairOff.apply(z, it, v))
    torch.manual_seed(seed)
    errs = deviation(off, "sinkhorn", 1024, 4, 512, torch.bfloat16, variant, 20, device="cpu")
    assert errs["fwd"] < 1e-6 and errs["bwd"] > SINKHORN_RTOL, errs


def test_sinkhorn_has_its_own_bound_and_old_files_are_refused_by_it():
    """Sinkhorn computes in fp32 whatever its logits: a bf16 sweep holds it to `SINKHORN_RTOL`, not
    the bf16 bound. The H200's wrong per-element backward (7.6e-3, 11-30) is refused, a mapping row
    with that error is not, and an older file's rows are refused by these bounds before winners are
    picked."""
    assert check_rtol("sinkhorn_occupancy", torch.bfloat16) == SINKHORN_RTOL < CHECK_RTOL[torch.float32]
    assert (
        grade("sinkhorn", torch.bfloat16, 7.6e-3) == "fail"
        and grade("mapping_bwd", torch.bfloat16, 7.6e-3) == "ok"
    )
    sk = CANDIDATES["sinkhorn"]
    rows = _sweep_rows()
    wrong = _stale_sinkhorn_rows()
    data = _sweep_doc(rows + wrong)
    t, _ = adopt.from_sweep(json.loads(json.dumps(data)), CANDIDATES, source="t.json")
    assert t.tiles["sinkhorn"] == sk[3]  # as recorded, the wrong candidate would win
    changed = regrade(data)
    assert len(changed) == 1 and "-> fail (0.0076)" in changed[0] and wrong[1]["check"] == "fail"
    t, _ = adopt.from_sweep(data, CANDIDATES, source="t.json")
    assert t.tiles["sinkhorn"] == sk[2]
    assert regrade(data) == [] and regrade({**data, "dtype": "fp8"}) == []


@pytest.mark.parametrize(
    ("row", "check"),
    [
        ({"check": "fail", "max_rel_err": 1e-5}, "fail"),  # never promoted
        ({"check": "ok", "max_rel_err": float("inf")}, "fail"),
        ({"max_rel_err": 5e-3}, "fail"),  # rows before 11-30 had no check
        ({"check": "ok", "max_rel_err": None}, "ok"),
        ({"check": "ok", "max_rel_err": True}, "ok"),
        ({"check": "ok", "max_rel_err": "7e-3"}, "ok"),
        ({"check": "ok", "max_rel_err": 7e-3, "error": "TileCompilerError"}, "ok"),
    ],
    ids=["fail-stays", "inf", "no-check", "none", "bool", "str", "error-row"],
)
def test_regrade_only_refuses_rows_with_a_numeric_error_beyond_the_bound(row, check):
    """`regrade` turns "ok" into "fail" beyond the bound and nothing else; odd rows keep what they recorded."""
    r = {"key": "sinkhorn", "tiles": "t", "direction": "bwd", **row}
    regrade({"dtype": "bf16", "rows": [r]})
    assert r.get("check", "ok") == check


def test_adopt_cli_refuses_a_stale_ok_beyond_the_bound(tmp_path, capsys):
    """`sweep --adopt` on a file whose fastest Sinkhorn row was "ok" under an older bound: the row is
    refused (and named on stderr), the next fastest candidate is adopted."""
    sk = CANDIDATES["sinkhorn"]
    wrong = _stale_sinkhorn_rows()
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_sweep_doc(_sweep_rows() + wrong)))
    out = tmp_path / "tuning.json"
    assert main(["--adopt", str(sweep), "--out", str(out)]) == 0
    assert "1 row(s) refused by this version's check bounds" in capsys.readouterr().err
    assert tuning.load(out).tiles["sinkhorn"] == sk[2]


def test_sweep_check_refuses_a_wrong_result(emu):
    """An op 2 % off the reference in the forward, or with a wrong gradient, fails the check."""
    off = dataclasses.replace(emu, h_aggregate=lambda x, h: ref.h_aggregate(x, h) * 1.05)
    errs = deviation(off, "h_aggregate_fwd", 40, 4, 512, torch.bfloat16, "megatron_dev", 3, device="cpu")
    assert errs["fwd"] > CHECK_RTOL[torch.bfloat16], errs

    class _Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, h):
            return ref.h_aggregate(x.detach(), h.detach())

        @staticmethod
        def backward(ctx, g):
            return None, None

    broken = dataclasses.replace(emu, h_aggregate=_Scaled.apply)
    errs = deviation(broken, "h_aggregate_bwd", 40, 4, 512, torch.bfloat16, "megatron_dev", 3, device="cpu")
    assert errs["bwd"] == float("inf"), errs


def test_precompiled_sweep_ignores_the_tuning():
    """The ahead-of-time cache records the sweep's launches as the sweep runs them: against the
    heuristics, so a shipped tuning changes none of them."""
    from tools.cutile import precompile

    def launches():
        recs = precompile.sweep_launches(
            tokens=32, n=4, hidden=256, dtype=torch.bfloat16, variant="megatron_dev"
        )
        return [(r.id, r.kernel_name, r.args, r.occupancy) for r in recs]

    plain = launches()
    with tiling.tuned(_tuning()):
        assert launches() == plain
        assert tiling.aggregate_tiles(4, 256, "fwd") == MMA_FWD  # the tuning is in force around it


def test_show_cli_lists_tiles_in_force(tmp_path, capsys):
    """`python -m tools.cutile.tiles FILE` shows, per key, the heuristic and what the tuning changes."""
    from tools.cutile.tiles import main as show

    path = tmp_path / "t.json"
    tuning.save(_tuning(), path)
    assert show([str(path), "--n", "4", "--hidden", "4096"]) == 0
    out = capsys.readouterr().out
    assert f"| h_aggregate_fwd | {tiling.aggregate_tiles(4, 4096, 'fwd')} | {MMA_FWD} | - |" in out
    assert "| h_post_bda_bwd |" in out and "{'h_post_bda_bwd_kernel': 4}" in out
    assert "| mapping_fwd | MappingTiles(tile_m=64, tile_k=128) | (same) | - |" in out
    assert show([str(path), "--n", "2"]) == 0
    assert str(MMA_FWD) not in capsys.readouterr().out  # another n: heuristics
    assert show([str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_sweep_check_refuses_a_non_finite_gain_gradient(emu):
    """A `[1]` gain's gradient is not compared (its sum can cancel to ~0), but a NaN there fails the check."""

    def nan_gain_grad(x, w, a_pre, a_post, a_res, bias, n, variant):
        return emu.mapping(x, w, a_pre.detach() + float("nan") * a_pre, a_post, a_res, bias, n, variant)

    torch.manual_seed(0)
    errs = deviation(
        dataclasses.replace(emu, mapping=nan_gain_grad),
        "mapping_bwd",
        40,
        4,
        512,
        torch.bfloat16,
        "megatron_dev",
        3,
        device="cpu",
    )
    assert errs["bwd"] == float("inf"), errs


def test_gpu_runtime_puts_the_device_tuning_in_force(tmp_path, monkeypatch, caplog):
    """The GPU runtime's creation (first launch) resolves the tuning for its device name, puts it in
    force and logs it once (the runtime and the device are stand-ins: no GPU here)."""
    import logging

    import mhc_core.kernels.cutile as cutile
    from mhc_core.kernels.cutile import runtime

    shipped = tmp_path / "tuned"
    shipped.mkdir()
    tuning.save(_tuning(), shipped / "nvidia_h200.json")
    monkeypatch.setattr(tuning, "TUNED_DIR", shipped)
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setattr(cutile, "availability", lambda: (True, "stand-in"))
    monkeypatch.setattr(runtime, "CuTileRuntime", lambda: "runtime")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(tiling, "_TUNING", None)
    cutile._default_runtime.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="mhc_core.kernels"):
            assert cutile._default_runtime() == "runtime"
        assert tiling.active_tuning() == _tuning()
        assert tiling.aggregate_tiles(4, 4096, "fwd") == MMA_FWD
        assert [r.getMessage() for r in caplog.records] == [
            f"cuTile tuning: {tuning.describe(tuning.load(shipped / 'nvidia_h200.json'))}"
        ]
    finally:
        cutile._default_runtime.cache_clear()


def test_recorded_h200_sweep_still_adopts_the_shipped_tuning(tmp_path):
    """The 11-30 H200 sweep file, read by this version (its bounds; its rows' tiles in this version's
    reprs, `adopt.canonical_tiles`, rows of retired formulations left out), adopts the tiles and hints of
    the shipped `tuned/nvidia_h200.json`."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "tuning.json"
    assert (
        main(["--adopt", str(root / "docs/measurements/h200-2026-11-30/run1-sweep.json"), "--out", str(out)])
        == 0
    )
    got, shipped = tuning.load(out), tuning.load(root / "mhc_core/kernels/cutile/tuned/nvidia_h200.json")
    assert (got.tiles, got.occupancy) == (shipped.tiles, shipped.occupancy)
    assert (
        shipped.digest() == "987e463037a3"
    )  # the file as shipped: a change to it is a change of the product


@pytest.mark.parametrize(
    ("key", "text", "want"),
    [
        (
            "sinkhorn",
            "SinkhornTiles(tile_b=128, batch_last=False, recompute=True, per_element=True, approx_div=True)",
            "SinkhornTiles(tile_b=128, per_element=True)",
        ),
        (
            "sinkhorn",
            "SinkhornTiles(tile_b=64, batch_last=False, recompute=False, per_element=False, approx_div=False)",
            "SinkhornTiles(tile_b=64, per_element=False)",
        ),
        (
            "sinkhorn",
            "SinkhornTiles(tile_b=64, batch_last=True, recompute=False, per_element=False, approx_div=False)",
            None,
        ),
        (
            "sinkhorn",
            "SinkhornTiles(tile_b=64, batch_last=False, recompute=False, per_element=True, approx_div=True)",
            None,
        ),
        (
            "h_post_bda_bwd",
            "StreamTiles(tile_t=8, tile_c=128, per_stream=True, loop_c=False, mma=False)",
            None,
        ),
        (
            "h_post_bda_bwd",
            "StreamTiles(tile_t=8, tile_c=64, per_stream=2, loop_c=False, mma=False, latency=9)",
            None,
        ),
        (
            "h_post_bda_fwd",
            "StreamTiles(tile_t=4, tile_c=256, per_stream=2, loop_c=True, mma=False)",
            "StreamTiles(tile_t=4, tile_c=256, per_stream=StreamLayout.TUPLE, loop_c=True, mma=False)",
        ),
        (
            "mapping_bwd",
            "MappingTiles(tile_m=16, tile_k=256, split_dx=False)",
            "MappingTiles(tile_m=16, tile_k=256)",
        ),
        ("mapping_bwd", "MappingTiles(tile_m=32, tile_k=128, split_dx=True)", None),
        (
            "h_aggregate_fwd_occupancy",
            "{'h_aggregate_fwd': StreamTiles(tile_t=8, tile_c=256, per_stream=0, loop_c=True, mma=True), "
            "'occupancy': {'h_aggregate_fwd_kernel': 4}}",
            "{'h_aggregate_fwd': StreamTiles(tile_t=8, tile_c=256, per_stream=StreamLayout.WHOLE, loop_c=True, mma=True), "
            "'occupancy': {'h_aggregate_fwd_kernel': 4}}",
        ),
        (
            "mapping_bwd_occupancy",
            "{'occupancy': {'mapping_bwd_coef_kernel': 2, 'mapping_bwd_dx_kernel': 2}}",
            None,
        ),
    ],
    ids=[
        "sinkhorn-tuned",
        "sinkhorn-default",
        "batch-last",
        "per-element-stored",
        "bwd-slices",
        "latency",
        "fwd-tuple",
        "mapping",
        "split-dx",
        "occupancy-dict",
        "retired-kernel-hint",
    ],
)
def test_canonical_tiles_reads_rows_written_before_a_retirement(key, text, want):
    """A sweep row's tiles read in this version's repr: retired fields at the value the tiles imply are
    dropped, a `per_stream` number becomes its `StreamLayout`, a retired formulation (a retired field at
    another value, a layout or kernel the kernels lack) reads as None."""
    assert adopt.canonical_tiles(key, text) == want


def test_canonical_tiles_refuses_text_that_is_no_tile():
    """Text that is no tile at all is an error naming the key and the text."""
    for text in ("StreamTiles(8, 64)", "__import__('os')", "SinkhornTiles(tile_b=8, colour=1)"):
        with pytest.raises(ValueError, match=r"h_post_bda_bwd: tiles .* is not a tile of this version"):
            adopt.canonical_tiles("h_post_bda_bwd", text)


def test_retired_registry_declares_every_retired_field():
    """Each retired tile field is selected by some declared formulation, names are unique, every entry
    names a tile key, fields the tile types no longer have (or layouts / mma they lack), and a verdict."""
    from tools.cutile import retired

    names = [r.name for r in retired.RETIRED]
    assert len(names) == len(set(names))
    declared = {f for r in retired.RETIRED for f in r.fields}
    for type_name, fields in retired.RETIRED_FIELDS.items():
        assert set(fields) <= declared, (
            f"{type_name}: {set(fields) - declared} retired without a declared formulation"
        )
        have = {f.name for f in dataclasses.fields(getattr(tiling, type_name))}
        assert not set(fields) & have, f"{type_name} still has {set(fields) & have}"
    for r in retired.RETIRED:
        assert r.key in tiling.TILE_KEYS and isinstance(r.verdict, retired.Verdict) and r.measured
    assert retired.by_name("stream-no-tma").verdict is retired.Verdict.UNTIMED
    with pytest.raises(KeyError, match="no retired formulation 'nope'"):
        retired.by_name("nope")


def test_retired_formulations_are_in_their_commits():
    """Each retired formulation's `commit` is a commit of this repository whose tile types still have the
    fields that selected it (skips where the clone has no history)."""
    import subprocess
    from pathlib import Path

    from tools.cutile import retired

    root = Path(__file__).resolve().parents[3]
    sources: dict[str, str] = {}
    for r in retired.RETIRED:
        if r.commit not in sources:
            show = subprocess.run(
                ["git", "-C", str(root), "show", f"{r.commit}:mhc_core/kernels/cutile/tiling.py"],
                capture_output=True,
                text=True,
                check=False,
            )
            if show.returncode != 0:
                pytest.skip(f"git cannot show {r.commit} here (no history?): {show.stderr.strip()[:120]}")
            sources[r.commit] = show.stdout
        for field in r.fields:
            assert f"    {field}: " in sources[r.commit], f"{r.name}: {r.commit} has no tile field {field}"
