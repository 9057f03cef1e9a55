"""Print the perf tables (Markdown) from a pytest-benchmark JSON file: ours, then the peers beside ours.

    python -m suites.perf.table results/perf.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: str | Path) -> list[str]:
    """One Markdown row per benchmark: op, direction, backend, shape, median, GB/s, roofline, speed-up,
    the back-to-back time and its roofline, the GPU busy time per call and its roofline (the bytes
    over the busy time against the same-run copy: the kernels alone; GPU runs), and for the layer
    its time overhead over the plain layer
    (in brackets: on a GPU the overhead in GPU busy time, and the bandwidth floor of the overhead)
    and saved-activation ratio."""
    data = json.loads(Path(path).read_text())
    out = ["| op | dir | backend | shape | median | GB/s | copy GB/s | roofline | vs reference | pipelined | "
           "roofline (pipelined) | GPU busy | roofline (busy) | layer overhead | layer saved act |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in sorted(data["benchmarks"], key=lambda b: (b["extra_info"].get("op", ""), b["name"])):
        e = b["extra_info"]
        if "peer" in e:
            continue
        op = e.get("op", b["name"])
        shape = e.get("shape", "-").removeprefix(f"{op}-")
        med = e.get("median_s", b["stats"]["median"])

        def f(key, scale=1.0, fmt="{:.2f}", e=e):
            return fmt.format(e[key] * scale) if key in e else "-"

        busy_roofline = (f"{e['bytes_per_s_busy'] / e['copy_bytes_per_s'] * 100:.0f} %"
                         if "bytes_per_s_busy" in e and e.get("copy_bytes_per_s") else "-")
        notes = [f"{name} {f(key, 100, '{:+.0f} %')}" for name, key in
                 (("GPU busy", "device_overhead_ratio"), ("floor", "floor_overhead_ratio")) if key in e]
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


def peer_rows(path: str | Path) -> list[str]:
    """One Markdown row per peer benchmark: the peer's time and roofline, ours (compiled) in the same run,
    our speed-up over it, and per op / direction / shape the fastest peer and our ratio to it; the
    conformance note says where the peer was checked. Empty when the file has no peer rows."""
    data = json.loads(Path(path).read_text())
    peers = [b["extra_info"] for b in data["benchmarks"] if "peer" in b["extra_info"]]
    if not peers:
        return []
    fastest: dict[tuple, dict] = {}
    for e in peers:
        key = (e["op"], e["direction"], e["shape"])
        if key not in fastest or e["median_s"] < fastest[key]["median_s"]:
            fastest[key] = e
    out = ["| op | dir | shape | peer | peer time | peer roofline | ours (compiled) | ours roofline | ours vs peer | "
           "fastest peer | ours vs fastest |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(peers, key=lambda e: (e["op"], e["direction"], e["shape"], e["median_s"])):
        best = fastest[(e["op"], e["direction"], e["shape"])]
        shape = e["shape"].removeprefix(f"{e['op']}-")
        out.append(
            f"| {e['op']} | {e['direction']} | {shape} | {e['peer']} | {e['median_s'] * 1e3:.3f} ms | "
            f"{e['roofline_ratio'] * 100:.0f} % | {e['ours_compiled_s'] * 1e3:.3f} ms | {e['ours_roofline_ratio'] * 100:.0f} % | "
            f"{e['speedup_vs_peer']:.2f}x | {best['peer']} | {best['median_s'] / e['ours_compiled_s']:.2f}x |")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m suites.perf.table <pytest-benchmark.json>", file=sys.stderr)
        return 2
    print("\n".join(rows(args[0])))
    peer = peer_rows(args[0])
    if peer:
        print("\nPeers beside ours (same run; 'ours vs' > 1: ours faster):\n")
        print("\n".join(peer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
