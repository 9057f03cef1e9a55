"""A Megatron training log read back as a result file: names, units, the mHC gain field, bad input."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.golden.errors import GoldenFormatError
from harness.golden.megatron_log import parse_log
from harness.golden.schema import load_golden

UPSTREAM = (
    " [2026-12-01 10:00:00] iteration        1/      50 | consumed samples:            8 | elapsed time per "
    "iteration (ms): 412.5 | learning rate: 1.500000E-03 | global batch size:     8 | lm loss: 1.087094E+01 |"
    " loss scale: 1.0 | grad norm: 3.626 | num zeros: 12.0 | number of skipped iterations:   0 |"
)
OURS = (
    " iteration        2/      24 | elapsed time per iteration (ms): 140.3 | learning rate: 3.000000E-03 | "
    "lm loss: 5.576416E+00 | grad norm: 3.530 | num zeros: 0 | mhc amax gain: 1.0000/1.0002 |"
)


def test_upstream_and_our_lines_become_series():
    """Upstream's fields map to the golden names (iteration time in seconds); our gain field becomes two series."""
    g = parse_log(["noise", UPSTREAM, "more noise", OURS], source="run.log")
    assert g["lm loss"].values == {1: 10.87094, 2: 5.576416}
    assert g["iteration-time"].values[1] == pytest.approx(0.4125)
    assert g["num-zeros"].values == {1: 12.0, 2: 0.0} and g["grad-norm"].values[2] == 3.53
    assert g["mhc-amax-gain-fwd"].values == {2: 1.0} and g["mhc-amax-gain-bwd"].values == {2: 1.0002}
    assert "learning-rate" not in g and "consumed-samples" not in g


def test_bad_logs_are_named():
    """A log without iteration lines, or with a NaN loss, is refused naming the file (and line)."""
    with pytest.raises(GoldenFormatError, match="run.log: no Megatron iteration lines"):
        parse_log(["hello"], source="run.log")
    with pytest.raises(GoldenFormatError, match=r"run.log: line 1 \(step 1\): lm loss is nan"):
        parse_log([UPSTREAM.replace("1.087094E+01", "nan")], source="run.log")


def test_import_log_writes_a_result_file_diff_can_read(tmp_path, capsys):
    """`mhc-harness import-log` writes the golden schema; `diff` then compares it with a golden file."""
    log = tmp_path / "train.log"
    log.write_text("\n".join([UPSTREAM, OURS]) + "\n")
    out = tmp_path / "run.json"
    assert 0 == main(
        ["import-log", str(log), "--out", str(out), "--metric", "lm loss", "--metric", "grad-norm"]
    )
    assert list(load_golden(out)) == ["lm loss", "grad-norm"]
    assert 0 == main(["diff", str(out), str(out)])
    assert 2 == main(["import-log", str(log), "--out", str(out), "--metric", "nope"])
    assert "no 'nope' in the log" in capsys.readouterr().err


def test_a_tensorboard_run_reads_back(tmp_path):
    """The monitor's scalars written through a real SummaryWriter (log_report) come back under their
    metric names, beside Megatron's own tags."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the test extra has it)")
    from torch.utils.tensorboard import SummaryWriter

    from harness.golden.megatron_log import read_log
    from mhc_core.monitor import StabilityReport, log_report

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in (10, 20):
        writer.add_scalar("lm loss", 5.0 - step / 10, step)
        log_report(
            StabilityReport(
                step=step,
                forward_gain=1.0 + step / 1000,
                backward_gain=1.0,
                worst_layer_gain=1.0,
                worst_layer="hc",
                sum_deviation=0.0,
                orientation_error=0.0,
                sublayers=4,
                tokens=64,
                seconds=0.001,
            ),
            tensorboard=writer,
        )
    writer.close()
    g = read_log(tmp_path / "tb")
    assert g["lm loss"].values == {10: 4.0, 20: 3.0}
    assert g["mhc-amax-gain-fwd"].values == pytest.approx({10: 1.01, 20: 1.02})
    out = tmp_path / "run.json"
    assert 0 == main(["import-log", str(tmp_path / "tb"), "--out", str(out), "--metric", "mhc-amax-gain-fwd"])
    assert list(load_golden(out)) == ["mhc-amax-gain-fwd"]
