"""Ours against the peers across the perf history: same-run ratios, "fell behind", the trend plot."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.perf.peer_trend import check_peers, format_peer_verdicts, peer_ratios

KEY = "peer-mapping-fwd::test_peer[T4096-n4-C1024-fp32-fwd-hf_deepseek_v4_compiled]"


def _bench_json(path, *, peer_s: float, ours_s: float, own_s: float = 1e-3):
    """A pytest-benchmark file with one of our benchmarks and one peer row as test_peers.py writes it."""
    peer_extra = {
        "op": "mapping",
        "direction": "fwd",
        "peer": "hf_deepseek_v4_compiled",
        "median_s": peer_s,
        "ours_compiled_s": ours_s,
        "speedup_vs_peer": peer_s / ours_s,
    }
    doc = {
        "machine_info": {},
        "commit_info": {"id": "c"},
        "datetime": "2026-12-01T00:00:00+00:00",
        "benchmarks": [
            {
                "group": "mapping",
                "name": "test_op[T4096]",
                "extra_info": {},
                "stats": {"median": own_s, "mean": own_s, "stddev": 0.0, "rounds": 5},
            },
            {
                "group": "peer-mapping-fwd",
                "name": KEY.split("::")[1],
                "extra_info": peer_extra,
                "stats": {"median": peer_s, "mean": peer_s, "stddev": 0.0, "rounds": 5},
            },
        ],
    }
    path.write_text(json.dumps(doc))
    return path


def _history(tmp_path, runs: list[tuple[float, float]]):
    h = tmp_path / "history.jsonl"
    for i, (peer_s, ours_s) in enumerate(runs):
        f = _bench_json(tmp_path / f"b{i}.json", peer_s=peer_s, ours_s=ours_s)
        assert 0 == main(["perf-history", "append", str(f), "--history", str(h), "--hw", "cpu_x86_64"])
    return h


def test_a_slower_machine_is_no_regression_when_the_ratio_holds(tmp_path, capsys):
    """Every time doubles in the newest run but our speed-up over the peer stays 1.3x: not a peer regression."""
    h = _history(tmp_path, [(1.3e-3, 1e-3)] * 5 + [(2.6e-3, 2e-3)])
    main(["perf-history", "check", "--history", str(h)])
    out = capsys.readouterr().out
    assert f"OK           {KEY} vs hf_deepseek_v4_compiled: ours 1.3x the peer's speed; baseline 1.3x" in out


def test_our_lead_shrinking_past_the_band_fails_naming_the_peer(tmp_path, capsys):
    """From 1.3x to 1.1x (-15 %) at the same machine speed: FELL BEHIND, exit 1."""
    h = _history(tmp_path, [(1.3e-3, 1e-3)] * 5 + [(1.1e-3, 1e-3)])
    assert 1 == main(["perf-history", "check", "--history", str(h), "--band-slow", "10"])
    out = capsys.readouterr().out
    assert (
        f"FELL BEHIND  {KEY} vs hf_deepseek_v4_compiled: ours 1.1x the peer's speed; baseline 1.3x "
        "(median of 5), change -15.4%, band -10%" in out
    )


def test_a_faster_peer_is_named_as_such(tmp_path):
    """Below 1x the verdict says the peer is faster, with or without a baseline."""
    rec = json.loads(_history(tmp_path, [(0.9e-3, 1e-3)]).read_text().splitlines()[-1])
    (v,) = check_peers([rec])
    assert (v.status, v.behind, round(v.ratio, 3)) == ("no_baseline", True, 0.9)
    assert "(the peer is faster); no baseline yet" in format_peer_verdicts([v])


def test_records_without_peer_rows_give_no_verdicts(tmp_path):
    """Only benchmarks that carry the same-run ratio count; other hardware keys are not a baseline."""
    recs = [
        {
            "hardware": "h200",
            "benchmarks": [{"key": KEY, "extra_info": {"speedup_vs_peer": 9.0, "peer": "p"}}],
        },
        {
            "hardware": "cpu",
            "benchmarks": [{"key": KEY, "extra_info": {"speedup_vs_peer": 1.0, "peer": "p"}}],
        },
        {"hardware": "cpu", "benchmarks": [{"key": "k", "extra_info": {}}]},
    ]
    assert check_peers(recs) == [] and peer_ratios(recs[0]) == {KEY: ("p", 9.0)}
    (v,) = check_peers(recs[:2])
    assert (v.status, v.n_baseline) == ("no_baseline", 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"band": 1.0}, r"band=1.0 must be in \[0, 1\)"), ({"window": 0}, r"window=0 must be >= 1")],
)
def test_bad_settings_name_the_value(kwargs, message):
    """A band of 100 % or a zero window is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        check_peers([{"hardware": "cpu", "benchmarks": []}], **kwargs)


def test_plot_draws_the_ratios_per_hardware(tmp_path):
    """`perf-history plot` writes the peers' trend PNG beside the timing ones."""
    h = _history(tmp_path, [(1.3e-3, 1e-3), (1.2e-3, 1e-3)])
    assert 0 == main(["perf-history", "plot", "--history", str(h), "--out", str(tmp_path / "plots")])
    png = tmp_path / "plots" / "perf_cpu_x86_64_peers.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "perf_cpu_x86_64_peers.png" in (tmp_path / "plots" / "cpu_x86_64.md").read_text()


def test_rows_written_apart_join_the_same_record(tmp_path, capsys):
    """`perf-history append --also` merges another benchmark file of the same run (the upstream tree's rows)
    into one record, so its peer ratio is checked with the others; a file without benchmarks, the extra or
    the main one, is refused."""
    main_run = _bench_json(tmp_path / "perf.json", peer_s=1.3e-3, ours_s=1e-3)
    tree = json.loads(_bench_json(tmp_path / "tree.json", peer_s=2e-3, ours_s=1e-3).read_text())
    tree["benchmarks"] = [
        dict(tree["benchmarks"][1], name="test_peer[T4096-n4-C1024-fp32-fwd-megatron_lm[main]]")
    ]
    (tmp_path / "tree.json").write_text(json.dumps(tree))
    h = tmp_path / "history.jsonl"
    assert 0 == main(
        [
            "perf-history",
            "append",
            str(main_run),
            "--also",
            str(tmp_path / "tree.json"),
            "--history",
            str(h),
            "--hw",
            "cpu_x86_64",
        ]
    )
    (rec,) = [json.loads(line) for line in h.read_text().splitlines()]
    assert len(rec["benchmarks"]) == 3 and sorted(r for _, r in peer_ratios(rec).values()) == pytest.approx(
        [1.3, 2.0]
    )
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    assert (
        main(
            [
                "perf-history",
                "append",
                str(main_run),
                "--also",
                str(tmp_path / "bad.json"),
                "--history",
                str(h),
                "--hw",
                "cpu_x86_64",
            ]
        )
        != 0
    )
    assert "bad.json: not a pytest-benchmark JSON file" in capsys.readouterr().err
    assert (
        main(
            [
                "perf-history",
                "append",
                str(tmp_path / "bad.json"),
                "--also",
                str(tmp_path / "tree.json"),
                "--history",
                str(h),
                "--hw",
                "cpu_x86_64",
            ]
        )
        != 0
    )  # the main file is checked too
    assert "bad.json: not a pytest-benchmark JSON file" in capsys.readouterr().err
    assert len(h.read_text().splitlines()) == 1  # nothing written on the way to either error
