"""`python -m tools.host_profile`: host time per call and where it goes, per op and backend."""

from __future__ import annotations

import json

import pytest
import torch

from mhc_core.kernels import dispatch
from tools import host_profile

SHAPE = ["--tokens", "16", "--hidden", "8", "--n", "4", "--dtype", "fp32", "--calls", "3", "--warmup", "1"]


def test_reference_profile_covers_every_op_and_direction(tmp_path, capsys):
    """On CPU the reference backend gives a forward and a backward row per op, with a positive host time, own
    times per area that add up to no more than the profiled call, and its top functions in descending order."""
    out = tmp_path / "host.json"
    assert (
        host_profile.main(
            [*SHAPE, "--backend", "reference", "--device", "cpu", "--top", "4", "--out", str(out)]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["op"], r["direction"]) for r in rows] == [
        (op, d) for op in ("mapping", "sinkhorn", "h_aggregate", "h_post_bda", "pre") for d in ("fwd", "bwd")
    ]
    for r in rows:
        assert r["host_us"] > 0 and r["profiled_us"] > 0, r
        assert set(r["area_us"]) == set(host_profile.AREAS)
        assert 0 < sum(r["area_us"].values()) <= r["profiled_us"] * 1.05, r
        own = [f["own_us"] for f in r["top"]]
        assert 1 <= len(own) <= 4 and own == sorted(own, reverse=True), r
    assert "mapping      fwd reference host" in capsys.readouterr().out


def test_backward_python_code_is_profiled():
    """The reference Sinkhorn's backward is a Python autograd.Function: its code shows in the backward profile
    (the profile runs the backward on the calling thread, where cProfile sees it)."""
    bwd = host_profile.profile_op(
        "sinkhorn",
        "reference",
        tokens=8,
        hidden=8,
        n=4,
        act=torch.float32,
        variant="megatron_main",
        iterations=3,
        device="cpu",
        calls=2,
        warmup=0,
        top=50,
    )[1]
    assert bwd.direction == "bwd"
    assert any(f.area == "mhc_core" and "backward" in f.name for f in bwd.top), [f.name for f in bwd.top]


@pytest.mark.skipif(dispatch.availability("cutile", "cpu")[0], reason="cuTile runs here")
def test_unavailable_backend_exits_2_naming_it(capsys):
    """A backend that cannot run on the device: exit 2 and the reason, no profile."""
    assert host_profile.main([*SHAPE, "--backend", "cutile", "--device", "cpu"]) == 2
    assert "backend cutile unavailable on cpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--calls", "0"], "--calls=0 must be >= 1"),
        (["--ops", "mapping,matmul"], "--ops: unknown matmul"),
        (["--warmup", "-1"], "--warmup=-1 must be >= 0"),
    ],
)
def test_bad_arguments_exit_2(argv, named, capsys):
    """Bad options are usage errors (exit 2) naming the option and the value."""
    with pytest.raises(SystemExit) as exc:
        host_profile.main([*SHAPE, "--backend", "reference", *argv])
    assert exc.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("filename", "area"),
    [
        ("~", "C functions"),
        ("/x/site-packages/torch/autograd/function.py", "torch"),
        ("/repo/mhc_core/kernels/cutile/mapping.py", "mhc_core"),
        ("/x/site-packages/cuda/tile/_compile.py", "cuda.tile"),
        ("<string>", "other"),
    ],
)
def test_area_of(filename, area):
    """Functions are grouped by where their code lives; C functions have the file `~`."""
    assert host_profile.area_of(filename) == area


def test_cutile_wrappers_show_in_the_profile(cutile_on_cpu, tmp_path):
    """The cuTile path end to end on CPU (the real launch wrappers, kernels on the interpreter): the forward and
    the backward profiles name the wrappers' autograd functions, in the mhc_core area."""
    out = tmp_path / "host.json"
    assert (
        host_profile.main(
            [
                *SHAPE,
                "--backend",
                "cutile",
                "--device",
                "cpu",
                "--ops",
                "h_aggregate",
                "--top",
                "200",
                "--calls",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    fwd, bwd = json.loads(out.read_text())["rows"]
    for row, method in ((fwd, "forward"), (bwd, "backward")):
        names = [f["name"] for f in row["top"] if f["area"] == "mhc_core"]
        assert any(n.startswith("streams.py:") and f"({method})" in n for n in names), names
