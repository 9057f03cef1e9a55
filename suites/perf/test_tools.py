"""The perf suite's own tools: registry sanity, the nsys SQLite reader, the table, the xdist guard."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.perf import table
from suites.perf import nsys
from tools import perf_cases as registry
from tools.perf_cases import OPS, cases_for

DEVICES = ("cpu", "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_registry_bytes_are_positive_and_ids_unique(device):
    """Every case has a positive bytes model in both directions and a unique id."""
    cases = cases_for(device)
    assert {c.op for c in cases} == set(OPS)
    assert len({c.id for c in cases}) == len(cases)
    for c in cases:
        assert c.bytes("fwd") > 0 and c.bytes("bwd") > 0, c.id


@pytest.mark.parametrize("onednn_bf16", [True, False], ids=["onednn-bf16", "no-onednn-bf16"])
def test_cpu_gap_drops_only_the_bf16_mapping_backward_without_onednn(monkeypatch, onednn_bf16):
    """Without oneDNN bf16 GEMMs, only the CPU bf16 mapping and pre fwdbwd are skipped (with the reason: their
    megatron_main backward's bf16 dx GEMM); else nothing."""
    monkeypatch.setattr(registry, "has_onednn_bf16", lambda: onednn_bf16)
    gaps = {(c.id, d): registry.cpu_gap(c, d) for c in cases_for("cpu") for d in ("fwd", "fwdbwd")}
    skipped = {key for key, why in gaps.items() if why}
    expected = (
        set()
        if onednn_bf16
        else {("mapping-T4096-n4-C2048-bf16", "fwdbwd"), ("pre-T4096-n4-C2048-bf16", "fwdbwd")}
    )
    assert skipped == expected, skipped
    assert all("oneDNN" in gaps[key] for key in skipped)
    assert all(registry.cpu_gap(c, d) is None for c in cases_for("cuda") for d in ("fwd", "fwdbwd"))


def _cache_bytes(level: int) -> int | None:
    """Per-instance size of the level-`level` data/unified cache from sysfs (Linux), else None."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")) if root.exists() else []:
        try:
            if (
                int((index / "level").read_text()) != level
                or (index / "type").read_text().strip() == "Instruction"
            ):
                continue
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2}.get(size[-1], 1)
        return int(size.rstrip("KM")) * mult
    return None


def test_largest_cpu_case_is_out_of_l2():
    """The largest CPU h_aggregate forward moves at least 8x the L2 of a core (so DRAM, not cache, is timed)."""
    l2 = _cache_bytes(2)
    if l2 is None:
        pytest.skip("no L2 size in /sys/devices/system/cpu/cpu0/cache")
    largest = max((c for c in cases_for("cpu") if c.op == "h_aggregate"), key=lambda c: c.bytes("fwd"))
    assert largest.bytes("fwd") >= 8 * l2, (largest.id, largest.bytes("fwd"), l2)


def test_case_inputs_match_the_reference_signature():
    """Every CPU case's inputs run through the reference op (shapes as the registry says)."""
    from mhc_core import ops

    for case in cases_for("cpu"):
        small = type(case)(op=case.op, tokens=8, n=case.n, hidden=16, dtype=case.dtype, device="cpu")
        out = getattr(ops, case.op)(*small.inputs(requires_grad=False))
        outs = out if isinstance(out, tuple) else (out,)
        assert all(torch.isfinite(o).all() for o in outs), case.id


def _synthetic_nsys(path: Path) -> None:
    """A minimal nsys export: 2 kernels names, 2 NVTX ranges (one via textId), a launch outside any range."""
    con = sqlite3.connect(path)
    con.executescript(
        """
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, streamId INT,
            correlationId INT, globalPid INT, demangledName INT, shortName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, correlationId INT, globalTid INT, nameId INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, text TEXT, textId INT, eventType INT, globalTid INT);
        INSERT INTO StringIds VALUES (1, 'agg_kernel'), (2, 'bda_kernel'), (3, 'mhc-perf:bda-fwd-cutile'), (4, 'cudaLaunchKernel');
        INSERT INTO NVTX_EVENTS VALUES (1000, 2000, 'mhc-perf:agg-fwd-cutile', NULL, 59, 7);
        INSERT INTO NVTX_EVENTS VALUES (3000, 4000, 'mhc-perf:agg-fwd-cutile', NULL, 59, 7);
        INSERT INTO NVTX_EVENTS VALUES (5000, 6000, NULL, 3, 59, 7);
        INSERT INTO NVTX_EVENTS VALUES (5000, 6000, 'a mark', NULL, 34, 7);
        INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (1100, 1150, 10, 7, 4), (3100, 3150, 11, 7, 4),
            (5100, 5150, 12, 7, 4), (5200, 5250, 13, 7, 4), (8000, 8050, 14, 7, 4), (1200, 1250, 15, 99, 4);
        INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES
            (1200, 1300, 0, 7, 10, 1, 1, 1), (3200, 3400, 0, 7, 11, 1, 1, 1),
            (5300, 5310, 0, 7, 12, 1, 2, 2), (5400, 5430, 0, 7, 13, 1, 2, 2),
            (8100, 8600, 0, 7, 14, 1, 1, 1), (1300, 1900, 0, 7, 15, 1, 2, 2);
        """
    )
    con.commit()
    con.close()


def test_nsys_kernel_summary(tmp_path):
    """kernel_summary groups CUPTI kernels by name with counts and GPU seconds."""
    db = tmp_path / "report.sqlite"
    _synthetic_nsys(db)
    stats = {k.name: k for k in nsys.kernel_summary(db)}
    assert stats["agg_kernel"].count == 3 and stats["agg_kernel"].total_s == pytest.approx(800e-9)
    assert stats["bda_kernel"].count == 3 and stats["bda_kernel"].max_s == pytest.approx(600e-9)


def test_nsys_nvtx_ranges_attribute_kernels_by_launch(tmp_path):
    """Kernels count for a range when launched on its thread inside it; text may come via textId."""
    db = tmp_path / "report.sqlite"
    _synthetic_nsys(db)
    ranges = nsys.nvtx_kernel_seconds(db, prefix=nsys.RANGE_PREFIX)
    assert set(ranges) == {"mhc-perf:agg-fwd-cutile", "mhc-perf:bda-fwd-cutile"}
    agg = ranges["mhc-perf:agg-fwd-cutile"]
    assert (agg.instances, agg.kernels) == (2, 2) and agg.per_instance_s == pytest.approx(150e-9)
    bda = ranges["mhc-perf:bda-fwd-cutile"]
    assert (bda.instances, bda.kernels) == (1, 2) and bda.kernel_s == pytest.approx(40e-9)


def test_nsys_rejects_a_non_export(tmp_path):
    """A file without the nsys tables is a ValueError naming the missing tables."""
    db = tmp_path / "other.sqlite"
    sqlite3.connect(db).close()
    with pytest.raises(ValueError, match="CUPTI_ACTIVITY_KIND_KERNEL"):
        nsys.kernel_summary(db)


def test_table_renders_rows(tmp_path, capsys):
    """The table prints one Markdown row per benchmark (shape without the op prefix) with GB/s, roofline, speed-up, busy roofline."""
    doc = {
        "benchmarks": [
            {
                "name": "test_kernel[x]",
                "stats": {"median": 0.002},
                "extra_info": {
                    "op": "h_aggregate",
                    "direction": "fwd",
                    "backend": "compiled",
                    "shape": "h_aggregate-T4-n4-C8",
                    "median_s": 0.001,
                    "bytes_per_s": 4e10,
                    "copy_bytes_per_s": 5e10,
                    "roofline_ratio": 0.8,
                    "speedup_vs_reference": 2.5,
                    "pipelined_s": 0.0008,
                    "roofline_ratio_pipelined": 0.95,
                    "device_busy_s": 0.0007,
                    "bytes_per_s_busy": 4.5e10,
                },
            },
            {
                "name": "test_layer[reference]",
                "stats": {"median": 0.03},
                "extra_info": {"op": "layer", "overhead_ratio": 0.5, "saved_bytes_ratio": 1.6},
            },
            {
                "name": "test_layer[compiled]",
                "stats": {"median": 0.02},
                "extra_info": {
                    "op": "layer",
                    "overhead_ratio": 0.3,
                    "floor_overhead_ratio": 0.04,
                    "saved_bytes_ratio": 1.6,
                },
            },
            {
                "name": "test_layer[cutile]",
                "stats": {"median": 0.02},
                "extra_info": {
                    "op": "layer",
                    "overhead_ratio": 2.0,
                    "device_overhead_ratio": 0.57,
                    "floor_overhead_ratio": 0.095,
                    "saved_bytes_ratio": 1.6,
                },
            },
        ]
    }
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(doc))
    assert table.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6
    assert (
        "| h_aggregate | fwd | compiled | T4-n4-C8 | 1.000 ms | 40.00 |" in out[2]
        and "80 %" in out[2]
        and "2.50x" in out[2]
    )
    assert "| 0.800 ms | 95 % | 0.700 ms | 90 % |" in out[2], out[2]  # busy: 4.5e10 / 5e10
    assert all(line.count("|") == out[0].count("|") == 16 for line in out), out
    assert [line.split("|")[13].strip() for line in out[2:]] == ["90 %", "-", "-", "-"]  # no busy bytes: "-"
    assert out[3].endswith("| +30 % (floor +4 %) | 1.60x |"), out[3]  # rows sort by name: compiled first
    assert out[4].endswith("| +200 % (GPU busy +57 %, floor +10 %) | 1.60x |"), out[4]
    assert out[5].endswith("| +50 % | 1.60x |"), out[5]


def test_busy_seconds_is_the_union_of_intervals():
    """GPU busy time counts overlapping kernel intervals (us) once and gaps not at all; None off CUDA."""
    from tools.device_time import busy_seconds, device_busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 10.0), (20.0, 25.0)]) == pytest.approx(15e-6)  # a 10 us launch gap
    assert busy_seconds([(20.0, 25.0), (0.0, 10.0), (5.0, 12.0), (12.0, 13.0)]) == pytest.approx(18e-6)
    with pytest.raises(ValueError, match=r"\(5.0, 1.0\)"):
        busy_seconds([(5.0, 1.0)])
    assert device_busy_seconds(lambda: None, "cpu") is None
    with pytest.raises(ValueError, match="calls=0"):
        device_busy_seconds(lambda: None, "cuda", calls=0)


def test_pipelined_seconds_times_each_fn_per_call():
    """Back-to-back timing returns one per-call figure per fn, and a slower fn measures slower."""
    import time

    from suites.perf.timing import pipelined_seconds

    fast, slow = (lambda: None), (lambda: time.sleep(0.002))
    f, s = pipelined_seconds([fast, slow], device="cpu", iters=3, rounds=2)
    assert 0 <= f < s and s >= 0.002


def test_synced_is_the_function_itself_on_cpu():
    """On CPU `synced` adds nothing (calls are synchronous); the wrapped function's result comes back."""
    from suites.perf.timing import synced

    fn = lambda: 7  # noqa: E731
    assert synced(fn, device="cpu") is fn and synced(fn, device="cpu")() == 7


def test_xdist_is_refused():
    """The perf conftest raises a UsageError under xdist (`-n 2`)."""
    from suites.perf.conftest import check_not_xdist

    with pytest.raises(pytest.UsageError, match="xdist"):
        check_not_xdist(SimpleNamespace(option=SimpleNamespace(numprocesses=2)))
    check_not_xdist(SimpleNamespace(option=SimpleNamespace(numprocesses=None)))


def test_saved_activation_bytes_counts_distinct_storages_without_params():
    """The memory probe counts each saved storage once and leaves parameters out."""
    from suites.perf.memory import peak_bytes, saved_activation_bytes

    x = torch.randn(64, 32, requires_grad=True)
    assert saved_activation_bytes(lambda: (x * 2.0).sin()) == 64 * 32 * 4  # sin saves its input once
    assert saved_activation_bytes(lambda: x * x) == 64 * 32 * 4  # x saved twice, one storage
    lin = torch.nn.Linear(32, 16)
    assert saved_activation_bytes(lambda: lin(x), lin.parameters()) == 64 * 32 * 4  # input only
    assert (
        saved_activation_bytes(lambda: lin(x)) == 64 * 32 * 4 + 16 * 32 * 4
    )  # weight counted when not excluded
    assert peak_bytes(lambda: None, "cpu") is None


def _peer(peer, median, ours, op="coefficients", shape="coefficients-T4-n4-C8-fp32", direction="fwd"):
    return {
        "name": f"test_peer[{peer}]",
        "stats": {"median": median},
        "extra_info": {
            "op": op,
            "direction": direction,
            "backend": peer,
            "peer": peer,
            "shape": shape,
            "median_s": median,
            "roofline_ratio": 0.1,
            "ours_compiled_s": ours,
            "ours_roofline_ratio": 0.4,
            "speedup_vs_peer": median / ours,
        },
    }


def test_peer_table_names_the_fastest_peer_and_our_ratio_to_it(tmp_path, capsys):
    """Peer rows go to their own table, sorted fastest first per op / direction / shape, each with our
    speed-up over that peer and over the fastest peer; the table of ours leaves them out."""
    doc = {
        "benchmarks": [
            _peer("hf_deepseek_v4", 0.004, 0.002),
            _peer("hf_deepseek_v4[compiled]", 0.003, 0.002),
            _peer("lucidrains", 0.010, 0.001, op="sinkhorn", shape="sinkhorn-T4-n4-fp32"),
        ]
    }
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(doc))
    assert len(table.rows(path)) == 2  # header only: no peer row among ours
    rows = table.peer_rows(path)
    assert rows[2].startswith(
        "| coefficients | fwd | T4-n4-C8-fp32 | hf_deepseek_v4[compiled] | 3.000 ms | 10 % |"
    )
    assert rows[2].endswith("| 1.50x | hf_deepseek_v4[compiled] | 1.50x |")
    assert rows[3].endswith("| 2.00x | hf_deepseek_v4[compiled] | 1.50x |"), rows[3]
    assert rows[4].endswith("| 10.00x | lucidrains | 10.00x |")
    assert table.main([str(path)]) == 0 and "Peers beside ours" in capsys.readouterr().out


def test_peer_cases_and_a_peer_that_does_not_conform_is_not_timed():
    """Peer cases have unique ids and positive bytes; a peer compared with the wrong variant fails
    `conforms_at` with its error (so it is skipped, not timed)."""
    pytest.importorskip(
        "transformers.models.deepseek_v4", reason="transformers (the peers extra) is not installed"
    )
    from suites.perf.peers import PeerCase, peer_cases, registry_peers

    cases = peer_cases("cpu")
    assert len({c.id for c in cases}) == len(cases) and all(
        c.bytes(d) > 0 for c in cases for d in ("fwd", "fwdbwd")
    )
    small = PeerCase(op="layer_mhc", tokens=8, n=4, hidden=8, dtype=torch.float32, device="cpu")
    hf = next(p for p in registry_peers() if p.name == "hf_deepseek_v4")
    assert hf.conforms_at(small)[0]
    wrong = hf.beside("megatron_main")  # untransposed mix: not DeepSeek-V4's
    ok, why = wrong.conforms_at(small)
    assert not ok and "its bound" in why


def test_low_precision_conformance_compares_errors_against_fp64_and_still_fails_a_wrong_variant():
    """In bf16 a peer whose worst error against fp64 is within 2x ours conforms; the untransposed mix does
    not, although the rule is looser than the elementwise bound."""
    pytest.importorskip(
        "transformers.models.deepseek_v4", reason="transformers (the peers extra) is not installed"
    )
    from suites.perf.peers import LOW_PRECISION_FACTOR, PeerCase, registry_peers

    case = PeerCase(op="layer_mhc", tokens=64, n=4, hidden=256, dtype=torch.bfloat16, device="cpu")
    hf = next(p for p in registry_peers() if p.name == "hf_deepseek_v4")
    ok, why = hf.conforms_at(case)
    assert ok, why
    ok, why = hf.beside("megatron_main").conforms_at(case)
    assert not ok and f"beyond {LOW_PRECISION_FACTOR:g}x ours" in why, why


def test_peer_table_reads_several_files_as_one_run(tmp_path):
    """The upstream tree's rows, written to a file of their own, join the peer table of the main run."""
    main, tree = tmp_path / "perf.json", tmp_path / "perf_megatron_lm.json"
    main.write_text(json.dumps({"benchmarks": [_peer("hf_deepseek_v4", 0.004, 0.002)]}))
    tree.write_text(json.dumps({"benchmarks": [_peer("megatron_lm[main]", 0.001, 0.002)]}))
    rows = table.peer_rows([main, tree])
    assert (
        len(rows) == 4
        and "megatron_lm[main]" in rows[2]
        and rows[2].endswith("| 0.50x | megatron_lm[main] | 0.50x |")
    )
    assert rows[3].endswith("| 2.00x | megatron_lm[main] | 0.50x |"), rows[3]


def test_peer_golden_band_holds_a_slower_machine_and_fails_a_lost_lead():
    """A peer row's golden checks our speed-up over the peer (two-sided, as our own perf goldens) on every
    device, the peer's time only on a GPU: a machine twice as slow with the ratio held passes on a CPU, a
    lead that drops from 1.3x to 1.0x fails, and a 1.3x -> 2.0x jump fails too (asks for a refresh)."""
    from harness.golden.compare import compare_metric
    from harness.golden.schema import series_from_list
    from suites.perf.peers import peer_golden

    peer, ours = [0.013] * 5, [0.010] * 5
    golden, checks = peer_golden(peer, ours, "cpu")
    assert set(checks) == {"speedup-vs-peer"} and set(golden) == {"iteration-time", "speedup-vs-peer"}
    assert set(peer_golden(peer, ours, "cuda")[1]) == {"speedup-vs-peer", "iteration-time"}
    want = series_from_list(golden["speedup-vs-peer"])

    def verdict(peer_s, ours_s):
        got = series_from_list(peer_golden(peer_s, ours_s, "cpu")[0]["speedup-vs-peer"])
        return compare_metric("speedup-vs-peer", got, want, checks["speedup-vs-peer"])

    assert verdict([0.026] * 5, [0.020] * 5).ok
    lost = verdict([0.010] * 5, [0.010] * 5)
    assert not lost.ok and "speedup-vs-peer" in lost.message, lost.message
    assert not verdict([0.020] * 5, [0.010] * 5).ok


def test_tree_peers_refuses_a_path_that_is_no_megatron_lm_tree(tmp_path, capsys):
    """`python -m suites.perf.tree_peers` names a bad --megatron-lm path and writes nothing."""
    from suites.perf import tree_peers

    out = tmp_path / "rows.json"
    assert tree_peers.main(["--megatron-lm", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "not a directory" in capsys.readouterr().err and not out.exists()
    (tmp_path / "empty").mkdir()
    assert tree_peers.main(["--megatron-lm", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "not a Megatron-LM tree" in capsys.readouterr().err and not out.exists()


_LIGER_CHECK = """
import json, torch
from harness.peers.liger import LigerPeer
from suites.perf.peers import PeerCase, registry_peers
why = LigerPeer().unavailable()
if why:
    print(json.dumps({"skip": why}))
    raise SystemExit(0)
liger = next(p for p in registry_peers() if p.name == "liger_kernel")
case = lambda op, dtype: PeerCase(op=op, tokens=8, n=4, hidden=16, dtype=dtype, device="cpu")
out = {"gpu_only": liger.unavailable(case("coefficients", torch.float32)),
       "rows": [[op, str(dt), *liger.conforms_at(case(op, dt))]
                for op in ("coefficients", "layer_mhc") for dt in (torch.float32, torch.bfloat16)],
       "plain": list(liger.beside("megatron_dev+eps_inside_sqrt").conforms_at(
           case("layer_mhc", torch.float32)))}
print(json.dumps(out))
"""


def test_liger_gpu_peer_conforms_to_its_configuration_interpreted():
    """The Liger-Kernel perf peer (timed on GPUs only) builds its coefficients and layer from Liger's functional
    API on our parameters and conforms to its configuration, fp32 and bf16, here through Triton's interpreter
    at a tiny size (a fresh process: the interpreter must be set before triton is imported); with dev's
    transposed mix instead of Liger's it does not conform."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _LIGER_CHECK], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["gpu_only"] == "liger_kernel is timed on NVIDIA GPUs only"
    assert all(ok for *_, ok, _ in out["rows"]), out["rows"]
    ok, why = out["plain"]
    assert not ok and "its bound" in why


def test_every_timed_peer_of_the_registry_has_its_entry_points():
    """Each registry peer with a `timing` implements `timed` on its own adapter (one home), the rows' names are
    unique, and the built-in timed peers are all there; a timing of an unknown op is refused naming it."""
    from harness.peers.base import Timing, has_own
    from suites.perf.peers import registry_peers

    rows = registry_peers()
    assert all(has_own(r.peer, "timed") for r in rows), [r.name for r in rows if not has_own(r.peer, "timed")]
    names = [r.name for r in rows]
    assert len(set(names)) == len(names), names
    assert {
        "hf_deepseek_v4",
        "hf_deepseek_v4[compiled]",
        "lucidrains",
        "te_triton",
        "tile_kernels",
        "liger_kernel",
    } <= set(names), names
    with pytest.raises(ValueError, match=r"\['mix'\] not among"):
        Timing(variant="paper", ops=frozenset({"mix"}))
