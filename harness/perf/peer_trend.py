"""Ours against each peer across the perf history: "we fell behind a peer" as a regression and a plot.

A peer benchmark of the perf suite (`suites/perf/test_peers.py`) records, in its `extra_info`, the
peer's time and ours (compiled) timed in the same run and their ratio `speedup_vs_peer` (peer time
over ours). A ratio taken in one run does not move with the machine's speed, so unlike a time it
can be compared across nights on a shared box. `check_peers` compares the newest record's ratio
per peer benchmark with the median of the previous `window` records of the same hardware key:
a ratio below `baseline * (1 - band)` is a regression (`fell_behind`), whether or not we are still
ahead. `plot_peers` draws the ratios, one PNG per hardware key, with the line where a peer is as
fast as we are.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.perf.history import save_trend, slug

__all__ = ["PeerVerdict", "check_peers", "format_peer_verdicts", "peer_ratios", "plot_peers"]

RATIO = "speedup_vs_peer"


@dataclass(frozen=True, kw_only=True)
class PeerVerdict:
    """Our speed-up over one peer at one op / direction / shape, newest against its baseline."""

    key: str
    peer: str
    ratio: float
    """Peer time over ours (compiled), both timed in the newest run: > 1 means we are faster."""
    baseline: float | None
    n_baseline: int
    band: float
    status: Literal["ok", "fell_behind", "no_baseline"]

    @property
    def behind(self) -> bool:
        """The peer is faster than we are in the newest run."""
        return self.ratio < 1.0


def _ratio(bench: Mapping[str, Any]) -> float | None:
    extra = bench.get("extra_info") or {}
    value = extra.get(RATIO)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value and value > 0
    return float(value) if ok else None


def peer_ratios(record: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """`{benchmark key: (peer, ratio)}` of the peer benchmarks of one history record."""
    out = {}
    for b in record.get("benchmarks", []):
        r = _ratio(b)
        if r is not None:
            out[b["key"]] = (str((b.get("extra_info") or {}).get("peer", "?")), r)
    return out


def check_peers(
    records: Sequence[Mapping[str, Any]], *, window: int = 5, band: float = 0.10
) -> list[PeerVerdict]:
    """A verdict per peer benchmark of the newest record (empty when it has none)."""
    if window < 1:
        raise ValueError(f"window={window!r} must be >= 1")
    if not 0 <= band < 1:
        raise ValueError(f"band={band!r} must be in [0, 1): the fraction our speed-up over a peer may drop")
    if not records:
        raise ValueError("the history has no records")
    newest = records[-1]
    prev = [peer_ratios(r) for r in records[:-1] if r.get("hardware") == newest.get("hardware")]
    out = []
    for key, (peer, ratio) in peer_ratios(newest).items():
        hist = [p[key][1] for p in prev if key in p][-window:]
        base = statistics.median(hist) if hist else None
        status: Literal["ok", "fell_behind", "no_baseline"] = (
            "no_baseline" if base is None else "fell_behind" if ratio < base * (1 - band) else "ok"
        )
        out.append(
            PeerVerdict(
                key=key, peer=peer, ratio=ratio, baseline=base, n_baseline=len(hist), band=band, status=status
            )
        )
    return out


def format_peer_verdicts(verdicts: Sequence[PeerVerdict]) -> str:
    """One line per peer benchmark: status, key, our speed-up now and its baseline, the band."""
    lines = []
    for v in verdicts:
        now = f"ours {v.ratio:.3g}x the peer's speed" + (" (the peer is faster)" if v.behind else "")
        if v.baseline is None:
            body = f"{now}; no baseline yet"
        else:
            body = (
                f"{now}; baseline {v.baseline:.3g}x (median of {v.n_baseline}), "
                f"change {v.ratio / v.baseline - 1:+.1%}, band -{v.band:.0%}"
            )
        tag = "FELL BEHIND" if v.status == "fell_behind" else v.status.upper()
        lines.append(f"{tag:<12} {v.key} vs {v.peer}: {body}")
    return "\n".join(lines)


def plot_peers(records: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """`perf_<hw>_peers.png` per hardware key with peer rows: our speed-up over each peer per record."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for i, r in enumerate(records):
        for key, (_peer, ratio) in peer_ratios(r).items():
            series.setdefault(str(r.get("hardware")), {}).setdefault(key.split("::", 1)[-1], []).append(
                (i, ratio)
            )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        save_trend(
            records,
            lines,
            out_dir / f"perf_{slug(hw)}_peers.png",
            ylabel="ours (compiled) speed-up over the peer [x]",
            reference=1.0,
            title=f"ours vs peers on {hw} (same-run ratios; below 1: the peer is faster)",
        )
        for hw, lines in sorted(series.items())
    ]
