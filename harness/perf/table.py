"""Print the perf tables (Markdown) from pytest-benchmark JSON files: ours, then the peers beside ours.

    python -m harness.perf.table results/perf.json [results/perf_megatron_lm.json ...]

Several files are read as one run (`suites/perf/tree_peers.py` writes the upstream tree's rows apart).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _benchmarks(paths: str | Path | list[str | Path]) -> list[dict]:
    paths = paths if isinstance(paths, list) else [paths]
    return [b for path in paths for b in json.loads(Path(path).read_text())["benchmarks"]]


def rows(path: str | Path | list[str | Path]) -> list[str]:
    """One Markdown row per benchmark: op, direction, backend, shape, median, GB/s, roofline, speed-up,
    the back-to-back time and its roofline, the GPU busy time per call and its roofline (the bytes
    over the busy time against the same-run copy: the kernels alone; GPU runs), and for the layer
    its time overhead over the plain layer
    (in brackets: on a GPU the overhead in GPU busy time, and the bandwidth floor of the overhead)
    and saved-activation ratio."""
    out = [
        "| op | dir | backend | shape | median | GB/s | copy GB/s | roofline | vs reference | pipelined | "
        "roofline (pipelined) | GPU busy | roofline (busy) | layer overhead | layer saved act |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in sorted(_benchmarks(path), key=lambda b: (b["extra_info"].get("op", ""), b["name"])):
        e = b["extra_info"]
        if "peer" in e:
            continue
        op = e.get("op", b["name"])
        shape = e.get("shape", "-").removeprefix(f"{op}-")
        med = e.get("median_s", b["stats"]["median"])

        def f(key, scale=1.0, fmt="{:.2f}", e=e):
            return fmt.format(e[key] * scale) if key in e else "-"

        busy_roofline = (
            f"{e['bytes_per_s_busy'] / e['copy_bytes_per_s'] * 100:.0f} %"
            if "bytes_per_s_busy" in e and e.get("copy_bytes_per_s")
            else "-"
        )
        notes = [
            f"{name} {f(key, 100, '{:+.0f} %')}"
            for name, key in (("GPU busy", "device_overhead_ratio"), ("floor", "floor_overhead_ratio"))
            if key in e
        ]
        floor = f" ({', '.join(notes)})" if notes else ""

        out.append(
            f"| {op} | {e.get('direction', '-')} | {e.get('backend', '-')} | {shape} | "
            f"{med * 1e3:.3f} ms | {f('bytes_per_s', 1e-9)} | {f('copy_bytes_per_s', 1e-9)} | "
            f"{f('roofline_ratio', 100, '{:.0f} %')} | {f('speedup_vs_reference', 1, '{:.2f}x')} | "
            f"{f('pipelined_s', 1e3, '{:.3f} ms')} | {f('roofline_ratio_pipelined', 100, '{:.0f} %')} | "
            f"{f('device_busy_s', 1e3, '{:.3f} ms')} | {busy_roofline} | "
            f"{f('overhead_ratio', 100, '{:+.0f} %')}{floor} | {f('saved_bytes_ratio', 1, '{:.2f}x')} |"
        )
    return out


def peer_rows(path: str | Path | list[str | Path]) -> list[str]:
    """One Markdown row per peer benchmark: the peer's time and roofline, ours (compiled) in the same run,
    our speed-up over it, and per op / direction / shape the fastest peer (the smallest same-run speed-up
    of ours) and that speed-up. Empty when the files have no peer rows."""
    peers = [b["extra_info"] for b in _benchmarks(path) if "peer" in b["extra_info"]]
    if not peers:
        return []
    # The fastest peer is the one our same-run speed-up is smallest over: each ratio is taken in its own run
    # (the upstream tree's rows come from another process and another torch), so times are not compared
    # across rows.
    fastest: dict[tuple, dict] = {}
    for e in peers:
        key = (e["op"], e["direction"], e["shape"])
        if key not in fastest or e["speedup_vs_peer"] < fastest[key]["speedup_vs_peer"]:
            fastest[key] = e
    out = [
        "| op | dir | shape | peer | peer time | peer roofline | ours (compiled) | ours roofline | ours vs peer | "
        "fastest peer | ours vs fastest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in sorted(peers, key=lambda e: (e["op"], e["direction"], e["shape"], e["median_s"])):
        best = fastest[(e["op"], e["direction"], e["shape"])]
        shape = e["shape"].removeprefix(f"{e['op']}-")
        out.append(
            f"| {e['op']} | {e['direction']} | {shape} | {e['peer']} | {e['median_s'] * 1e3:.3f} ms | "
            f"{e['roofline_ratio'] * 100:.0f} % | {e['ours_compiled_s'] * 1e3:.3f} ms | {e['ours_roofline_ratio'] * 100:.0f} % | "
            f"{e['speedup_vs_peer']:.2f}x | {best['peer']} | {best['speedup_vs_peer']:.2f}x |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m harness.perf.table <pytest-benchmark.json> [more.json ...]", file=sys.stderr)
        return 2
    print("\n".join(rows(args)))
    peer = peer_rows(args)
    if peer:
        print("\nPeers beside ours (same run; 'ours vs' > 1: ours faster):\n")
        print("\n".join(peer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
