"""Compare a pipelined run's per-rank records with the single-process reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "RunRecord",
    "compare_to_reference",
    "differences_by_layer",
    "load_run",
    "unsharded",
    "worst_differences",
]


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """Losses (last stage), and per step `{full name: [(value, partition_dim, tp_rank, tp_size), ...]}`."""

    losses: list[list[float]]
    grads: list[dict[str, list[dict]]]
    weights: list[dict[str, list[dict]]]
    shapes: dict[int, list[tuple[str, tuple[int, ...]]]]
    aux_losses: list[dict[str, torch.Tensor]]
    """Per step, the MoE routers' tracked losses `{name: [layers]}` summed over the ranks (each layer's value lives
    on the rank that holds the layer; empty without MoE)."""
    mtp_losses: list[list[list[float]]]
    """Per step and microbatch, the MTP loss of each depth (`mtp_<k> loss`; empty lists without MTP)."""


def unsharded(run: RunRecord) -> RunRecord:
    """`run` with every TP-split tensor joined whole (its slices concatenated in TP-rank order), one entry per
    name: a TP run as the reference of another TP run."""

    def join(step: dict[str, list[dict]]) -> dict[str, list[dict]]:
        out = {}
        for name, entries in step.items():
            by_rank = {e["tp_rank"]: e for e in entries}
            first = by_rank[min(by_rank)]
            value = (
                first["value"]
                if first["partition_dim"] is None
                else torch.cat([by_rank[r]["value"] for r in sorted(by_rank)], dim=first["partition_dim"])
            )
            out[name] = [{"value": value, "partition_dim": None, "tp_rank": 0, "tp_size": 1}]
        return out

    return RunRecord(
        losses=run.losses,
        grads=[join(g) for g in run.grads],
        weights=[join(w) for w in run.weights],
        shapes=run.shapes,
        aux_losses=run.aux_losses,
        mtp_losses=run.mtp_losses,
    )


def load_run(directory: Path) -> RunRecord:
    """Merge the `rank<r>.pt` files of one run."""
    files = sorted(Path(directory).glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    if not files:
        raise FileNotFoundError(f"no rank*.pt files in {directory}")
    records = [torch.load(f) for f in files]
    steps = len(records[0]["grads"])
    # The loss of each data-parallel rank's microbatches (from its first rank that holds them), in DP order.
    by_dp: dict[int, dict] = {}
    for r in records:
        if r["losses"] and r["losses"][0]:
            by_dp.setdefault(r.get("dp_rank", 0), r)

    def per_microbatch(key: str) -> list[list]:
        return [
            [mb for d in sorted(by_dp) for mb in by_dp[d].get(key, [[]] * steps)[step]]
            for step in range(steps)
        ]

    losses = per_microbatch("losses") if by_dp else []
    mtp_losses = per_microbatch("mtp_losses") if by_dp else []
    merged_g: list[dict] = [{} for _ in range(steps)]
    merged_w: list[dict] = [{} for _ in range(steps)]
    for r in records:
        for step in range(steps):
            for src, dst in ((r["grads"][step], merged_g[step]), (r["weights"][step], merged_w[step])):
                for name, entry in src.items():
                    dst.setdefault(name, []).append(entry)
    aux: list[dict[str, torch.Tensor]] = [{} for _ in range(steps)]
    for r in records:
        for step, tracked in enumerate(r.get("aux_losses", [])):
            for name, values in tracked.items():
                aux[step][name] = aux[step][name] + values if name in aux[step] else values.clone()
    return RunRecord(
        losses=losses,
        grads=merged_g,
        weights=merged_w,
        shapes={r["rank"]: r["shapes"] for r in records},
        aux_losses=aux,
        mtp_losses=mtp_losses,
    )


FLOOR = 1e-3
"""A tensor is compared relative to max(max |ref|, FLOOR * the largest |ref| entry of the model
at that step): fp32 rounding in a cancellation-dominated gradient (an alpha whose gradient is
1e-9 while the model's is 0.1) is not a pipeline error, but a missing microbatch still is."""


def _relative(actual: torch.Tensor, expected: torch.Tensor, model_scale: float) -> float:
    scale = max(float(expected.abs().max()), FLOOR * model_scale, 1e-30)
    return float((actual - expected).abs().max()) / scale


def _tensor_pairs(run: RunRecord, ref: RunRecord):
    """Each (kind, step, name, entry, expected slice, model scale) of the run's grads and weights that the
    reference also holds, `expected` being the reference's slice for the entry's TP rank."""
    for kind, mine, theirs in (("grad", run.grads, ref.grads), ("weight", run.weights, ref.weights)):
        for step, (got, want) in enumerate(zip(mine, theirs, strict=True)):
            model_scale = max(
                float(v[0]["value"].abs().max()) for v in want.values() if v[0]["value"].numel()
            )
            for name, entries in got.items():
                if name not in want:
                    continue
                full = want[name][0]["value"]
                for e in entries:
                    expected = full
                    if e["partition_dim"] is not None:
                        expected = full.chunk(e["tp_size"], dim=e["partition_dim"])[e["tp_rank"]]
                    yield kind, step, name, e, expected, model_scale


def compare_to_reference(run: RunRecord, ref: RunRecord, rtol: float) -> list[str]:
    """Every mismatch as a line with the numbers; empty when the run reproduces the reference.

    Losses compare per microbatch (relative); each gradient / weight tensor compares as
    max |a - e| / max(max |e|, FLOOR * model scale) over the tensor (the TP slice a rank holds
    against the same slice of the reference).
    """
    problems = []
    if len(run.losses) != len(ref.losses):
        problems.append(f"losses: {len(run.losses)} steps vs reference {len(ref.losses)}")
    for step, (got, want) in enumerate(zip(run.losses, ref.losses, strict=False)):
        for mb, (a, e) in enumerate(zip(got, want, strict=True)):
            if abs(a - e) > rtol * abs(e):
                problems.append(f"loss step {step} microbatch {mb}: {a:.9g} vs reference {e:.9g}")
    for step, (got_mtp, want_mtp) in enumerate(zip(run.mtp_losses, ref.mtp_losses, strict=False)):
        if len(got_mtp) != len(want_mtp):
            problems.append(
                f"mtp losses step {step}: {len(got_mtp)} microbatches vs reference {len(want_mtp)}"
            )
        for mb, (a_d, e_d) in enumerate(zip(got_mtp, want_mtp, strict=False)):
            if len(a_d) != len(e_d) or any(abs(a - e) > rtol * abs(e) for a, e in zip(a_d, e_d, strict=True)):
                problems.append(f"mtp losses step {step} microbatch {mb}: per depth {a_d} vs reference {e_d}")
    for step, (got_aux, want_aux) in enumerate(zip(run.aux_losses, ref.aux_losses, strict=False)):
        if set(got_aux) != set(want_aux):
            problems.append(
                f"aux losses step {step}: tracked {sorted(got_aux)} vs reference {sorted(want_aux)}"
            )
        for name in set(got_aux) & set(want_aux):
            a_v, e_v = got_aux[name], want_aux[name]
            if a_v.shape != e_v.shape or not bool(((a_v - e_v).abs() <= rtol * e_v.abs()).all()):
                problems.append(
                    f"aux loss {name} step {step}: per layer {a_v.tolist()} vs reference {e_v.tolist()}"
                )
    for kind, mine, theirs in (("grad", run.grads, ref.grads), ("weight", run.weights, ref.weights)):
        for step, (got, want) in enumerate(zip(mine, theirs, strict=True)):
            missing = sorted(set(want) - set(got))
            if missing:
                problems.append(
                    f"{kind} step {step}: parameters missing from the pipelined run: {missing[:5]}"
                )
            problems += [
                f"{kind} step {step}: {name} not in the reference" for name in got if name not in want
            ]
    for kind, step, name, e, expected, model_scale in _tensor_pairs(run, ref):
        if expected.shape != e["value"].shape:
            problems.append(
                f"{kind} step {step} {name}: shape {list(e['value'].shape)} vs {list(expected.shape)}"
            )
            continue
        rel = _relative(e["value"], expected, model_scale)
        if not rel <= rtol:
            problems.append(
                f"{kind} step {step} {name} (tp rank {e['tp_rank']}): max rel err {rel:.3e} > {rtol:g}; "
                f"max |ref| {float(expected.abs().max()):.3e}"
            )
    return problems


def worst_differences(run: RunRecord, ref: RunRecord) -> dict[str, float]:
    """The largest difference of each kind over every step: `{"loss": max relative, "grad": ..., "weight": ...}`,
    tensors measured as `compare_to_reference` measures them (parameters missing on either side, or of
    another shape, are skipped: `compare_to_reference` names them)."""
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for got, want in zip(run.losses, ref.losses, strict=False):
        for a, e in zip(got, want, strict=False):
            worst["loss"] = max(worst["loss"], abs(a - e) / max(abs(e), 1e-30))
    for kind, _step, _name, e, expected, model_scale in _tensor_pairs(run, ref):
        if expected.shape == e["value"].shape:
            worst[kind] = max(worst[kind], _relative(e["value"], expected, model_scale))
    return worst


def differences_by_layer(run: RunRecord, ref: RunRecord) -> dict[str, dict[str, float]]:
    """The largest gradient and post-step weight difference of each decoder layer over every step (measured as
    `compare_to_reference` does), keyed `layer <i>`, and `other` for the embedding, output layer and final norm."""
    import re

    out: dict[str, dict[str, float]] = {}
    for kind, _step, name, e, expected, model_scale in _tensor_pairs(run, ref):
        if expected.shape != e["value"].shape:
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        row = out.setdefault(f"layer {m.group(1)}" if m else "other", {"grad": 0.0, "weight": 0.0})
        row[kind] = max(row[kind], _relative(e["value"], expected, model_scale))
    return dict(
        sorted(
            out.items(), key=lambda kv: (kv[0] == "other", int(kv[0].split()[-1]) if kv[0] != "other" else 0)
        )
    )
