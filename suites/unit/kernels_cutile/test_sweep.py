"""The tile sweep's candidates are legal tiles: each runs its op through the CPU kernel interpreter."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mhc_core.kernels.cutile import CuTileBackend, tiling
from mhc_core.kernels.dispatch import bound_ops
from tools.cutile.emulator import EmulatedRuntime
from tools.cutile.sweep import CANDIDATES, KEY_ORDER, override, timers

# Kernel outputs start as NaN: an unwritten tile fails (conftest.poisoned_empty).
pytestmark = pytest.mark.usefixtures("poisoned_empty")


CASES = [
    pytest.param(key, cand, id=f"{key}-{i}")
    for key, cands in CANDIDATES.items()
    for i, cand in enumerate(cands)
]


@pytest.fixture(scope="module")
def emu():
    return bound_ops(CuTileBackend(EmulatedRuntime(num_sms=4)))


@pytest.mark.parametrize(("key", "cand"), CASES)
def test_candidate_runs_and_is_finite(emu, key, cand):
    """Every candidate of every key runs its op's timed direction(s) and gives finite results."""
    with tiling.overridden(**override(key, cand)):
        fns = timers(emu, key, 40, 4, 1024, torch.bfloat16, "megatron_dev", 3, device="cpu")
        assert fns, f"{key}: no direction to time"
        for direction, fn in fns.items():
            result = fn()
            tensors = result if isinstance(result, tuple) else (result,)
            for t in tensors:
                assert torch.isfinite(t.float()).all(), f"{key}={cand} {direction}: non-finite result"


def test_occupancy_override_is_checked():
    """An occupancy hint names known kernels and lies in 1-32; it is readable only inside its block."""
    with tiling.overridden(occupancy={"h_aggregate_fwd_kernel": 4}):
        assert tiling.occupancy("h_aggregate_fwd_kernel") == 4
        assert tiling.occupancy("h_post_bda_fwd_kernel") is None
    assert tiling.occupancy("h_aggregate_fwd_kernel") is None
    with pytest.raises(ValueError, match="occupancy"):
        with tiling.overridden(occupancy={"h_aggregate_fwd_kernel": 64}):
            pass
    with pytest.raises(ValueError, match="occupancy"):
        with tiling.overridden(occupancy={"no_such_kernel": 2}):
            pass
    with pytest.raises(ValueError, match="mapping"):
        with tiling.overridden(occupancy=[4]):
            pass
    with pytest.raises(ValueError, match="expected a StreamTiles"):
        with tiling.overridden(h_aggregate_fwd=tiling.MappingTiles()):
            pass


def test_first_candidate_is_the_default():
    """The first candidate of each stream key is what the heuristic picks at n = 4, C = 4096."""
    assert CANDIDATES["sinkhorn"][0] == tiling.sinkhorn_tile(4)
    assert all(key.removesuffix("_occupancy") in tiling.KERNELS_OF for key in CANDIDATES)
    for op, fn in (
        ("h_aggregate", tiling.aggregate_tiles),
        ("h_post_bda", tiling.post_bda_tiles),
        ("mapping", lambda n, c, d: tiling.mapping_tiles(n, n * c, d)),
    ):
        for direction in ("fwd", "bwd"):
            assert CANDIDATES[f"{op}_{direction}"][0] == fn(4, 4096, direction)


def test_every_key_is_swept_in_priority_order():
    """Each tile key and its occupancy key has candidates, in `KEY_ORDER` (backwards first): the
    reordering drops none."""
    keys = list(tiling.KERNELS_OF)
    assert sorted(CANDIDATES) == sorted(keys + [f"{k}_occupancy" for k in keys])
    assert list(CANDIDATES) == list(KEY_ORDER)
    assert list(CANDIDATES)[:3] == ["h_post_bda_bwd", "mapping_bwd", "sinkhorn"]


def test_list_prints_every_candidate(capsys):
    """`--list` prints one `key index` line per candidate (what gpu_check's parallel warm-up reads), no GPU needed."""
    from tools.cutile.sweep import main

    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(len(c) for c in CANDIDATES.values())
    assert lines[0] == f"{KEY_ORDER[0]} 0" and all(len(line.split()) == 2 for line in lines)


def test_summary_picks_fastest_and_counts_failures(tmp_path, capsys):
    """`--summary` names the fastest candidate per key and direction, its speed-up over the key's
    default (for `*_occupancy` keys: the unhinted default), and counts failures."""
    from tools.cutile.sweep import main

    default = repr(CANDIDATES["h_aggregate_fwd"][0])

    def row(key, tiles, ms):
        return {
            "key": key,
            "tiles": tiles,
            "direction": "fwd",
            "single_ms": ms,
            "pipelined_ms": ms,
            "gb_per_s": round(320 / ms),
        }

    rows = [
        row("h_aggregate_fwd", default, 0.8),
        row("h_aggregate_fwd", "B", 0.2),
        {"key": "h_aggregate_fwd", "tiles": "C", "error": "TileCompilerError: x"},
        row("h_aggregate_fwd_occupancy", "occ2", 0.4),
        row("h_aggregate_fwd_occupancy", "occ4", 0.5),
        row("mapping_fwd", "not the default", 0.3),
        {"key": "sinkhorn", "tiles": "S", "error": "RuntimeError: y"},
    ]
    path = tmp_path / "sweep.json"
    path.write_text(
        json.dumps(
            {
                "tokens": 8,
                "n": 4,
                "hidden": 64,
                "dtype": "bf16",
                "variant": "megatron_dev",
                "device": "test",
                "rows": rows,
            }
        )
    )
    assert main(["--summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| h_aggregate_fwd | fwd | 0.8000 | B | 0.2000 | 1600 | 4.00x | 1 |" in out
    assert "| h_aggregate_fwd_occupancy | fwd | 0.8000 | occ2 | 0.4000 | 800 | 2.00x | 0 |" in out
    assert "| mapping_fwd | fwd | - | not the default | 0.3000 | 1067 | - | 0 |" in out
    assert "| sinkhorn | - | - | all 1 candidates failed |" in out
    # Rows with GPU busy time are ranked by it: back-to-back times that only measure the host
    # (equal for every tile) do not pick the winner.
    busy = [
        dict(row("sinkhorn", repr(CANDIDATES["sinkhorn"][0]), 0.044), device_ms=0.012),
        dict(row("sinkhorn", "P", 0.043), device_ms=0.020),
        dict(row("sinkhorn", "E", 0.045), device_ms=0.004),
    ]
    path.write_text(json.dumps({"rows": busy}))
    assert main(["--summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "GPU busy ms" in out and "| sinkhorn | fwd | 0.0120 | E | 0.0040 |" in out and "| 3.00x |" in out
    ), out
    path.write_text("{not json")
    assert main(["--summary", str(path)]) == 2
    assert f"sweep --summary: {path}: not JSON" in capsys.readouterr().err


def test_summary_finds_the_default_in_a_sweep_file_written_before_the_cut(tmp_path, capsys):
    """A row naming the default in the repr of an older version (retired fields at the value the tiles
    imply, `per_stream=True`) is still the default's time in `--summary`."""
    from tools.cutile.sweep import main

    old_default = "StreamTiles(tile_t=8, tile_c=256, per_stream=True, loop_c=False, mma=False, latency=0)"
    assert repr(CANDIDATES["h_aggregate_fwd"][0]) != old_default
    rows = [
        {
            "key": "h_aggregate_fwd",
            "tiles": t,
            "direction": "fwd",
            "single_ms": ms,
            "pipelined_ms": ms,
            "gb_per_s": 1.0,
        }
        for t, ms in ((old_default, 0.6), ("B", 0.2))
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    assert main(["--summary", str(path)]) == 0
    assert "| h_aggregate_fwd | fwd | 0.6000 | B | 0.2000 | 1 | 3.00x | 0 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"tiles": "A"}], r"rows\[0\] is not a sweep row"),
        (
            [{"key": "sinkhorn", "tiles": "A", "direction": "fwd", "pipelined_ms": None}],
            r"rows\[0\] \(sinkhorn A\): its time .* is None, not a finite number > 0",
        ),
        (
            [{"key": "sinkhorn", "tiles": "A", "direction": "up", "pipelined_ms": 1.0}],
            r"rows\[0\] \(sinkhorn A\): direction='up'",
        ),
        ({"a": 1}, r"rows must be a list, got dict"),
    ],
    ids=["no-key", "no-time", "direction", "rows-dict"],
)
@pytest.mark.parametrize("flag", ["--summary", "--adopt"])
def test_malformed_sweep_rows_are_named_not_a_traceback(tmp_path, capsys, rows, message, flag):
    """--summary and --adopt refuse a malformed row naming the file and the row (exit 2), and write nothing."""
    from tools.cutile.sweep import main

    path, out = tmp_path / "sweep.json", tmp_path / "tuning.json"
    path.write_text(json.dumps({"n": 4, "device": "test", "rows": rows}))
    assert main([flag, str(path), "--out", str(out)]) == 2
    assert re.search(rf"sweep {flag}: {re.escape(str(path))}: {message}", capsys.readouterr().err)
    assert not out.exists()


def test_adopt_names_the_sweep_not_the_output_and_writes_nothing_when_nothing_wins(tmp_path, capsys):
    """A bad device or n is reported against the sweep file; a sweep with no usable winner writes no tuning."""
    from tools.cutile.sweep import main

    path, out = tmp_path / "sweep.json", tmp_path / "tuning.json"
    path.write_text(json.dumps({"n": 4, "device": 7, "rows": []}))
    assert main(["--adopt", str(path), "--out", str(out)]) == 2
    assert f"sweep --adopt: {path}: device=7 must be the GPU's name" in capsys.readouterr().err
    failed = {
        "key": "sinkhorn",
        "tiles": repr(CANDIDATES["sinkhorn"][0]),
        "direction": "fwd",
        "device_ms": 0.1,
        "check": "fail",
    }
    path.write_text(json.dumps({"n": 4, "device": "test", "rows": [failed]}))
    assert main(["--adopt", str(path), "--out", str(out)]) == 1
    assert "nothing adopted (1 rows, 0 passed their check)" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):  # one file at a time: --summary and --adopt exclude each other
        main(["--summary", str(path), "--adopt", str(path), "--out", str(out)])


def test_tuning_cli_refuses_an_n_without_kernels(capsys):
    """`python -m tools.cutile.tiles --n 3` (no kernels) and --hidden 0 are usage errors."""
    from tools.cutile.tiles import main

    for argv, msg in (
        (["--n", "3"], "--n 3: the cuTile kernels exist for n in (2, 4, 8)"),
        (["--n", "0"], "--n 0:"),
        (["--hidden", "0"], "--hidden 0: must be >= 1"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_write_json_replaces_the_file_whole(tmp_path):
    """The GPU tools' `--out` writer replaces the file atomically and leaves no temporary behind."""
    from tools.cutile.bench import write_json

    path = tmp_path / "out.json"
    path.write_text("old")
    write_json(str(path), {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError):  # a directory in the way: the error, and no temporary left
        write_json(str(tmp_path / "adir"), {"rows": []})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "out.json"]


@pytest.mark.usefixtures("poisoned_empty")
def test_whole_sweep_loop_runs_on_the_interpreter(tmp_path, capsys):
    """`sweep --emulate` runs the GPU tool's own loop on the CPU interpreter: every candidate of the keys
    is checked against the reference (all pass) and written; `--summary` and `--adopt` read the file."""
    from mhc_core.kernels.cutile import tuning
    from tools.cutile.sweep import main

    torch.manual_seed(0)
    out = tmp_path / "sweep.json"
    keys = ["h_aggregate_fwd", "h_post_bda_bwd_occupancy", "sinkhorn_occupancy"]
    assert (
        main(
            [
                "--emulate",
                "--tokens",
                "32",
                "--hidden",
                "256",
                "--iterations",
                "3",
                "--iters",
                "1",
                "--keys",
                ",".join(keys),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["device"] == "CPU kernel interpreter"
    assert [r for r in rows if "error" in r or r["check"] != "ok"] == []
    expected = sum(len(CANDIDATES[k]) * (2 if k.startswith("sinkhorn") else 1) for k in keys)
    assert len(rows) == expected and all(r["max_rel_err"] < 1e-2 and "device_ms" not in r for r in rows)
    capsys.readouterr()
    assert main(["--summary", str(out)]) == 0
    assert "| h_aggregate_fwd | fwd |" in capsys.readouterr().out
    tuned = tmp_path / "tuning.json"
    assert main(["--adopt", str(out), "--out", str(tuned), "--min-gain", "1.0"]) == 0
    assert tuning.load(tuned).n == 4  # whatever won on the interpreter: a valid, loadable tuning
