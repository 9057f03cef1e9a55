"""The conformance matrix as text (terminal), Markdown (a section of `report.md`) and JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.conformance.matrix import Cell, Matrix, PeerResult
from mhc_core.variants import get_variant

__all__ = ["format_summary", "markdown", "read_matrix_json", "write_outputs"]


def _cell_text(c: Cell) -> str:
    if c.status in ("n/a", "error"):
        return c.status
    if c.observed is not None:
        return f"{c.observed} ({c.status})"
    return f"{c.max_abs:.1e} ({c.ratio:.2g}x bound) {c.status}" if c.max_abs is not None else c.status


def _scores(p: PeerResult) -> str:
    return ", ".join("{} {}/{}".format(v, *p.tally(v)) for v in p.by_variant)


def _configuration(p: PeerResult) -> str:
    """The best configuration and its passes over all its checks (`-` when there is none)."""
    if p.configuration is None or p.configuration not in p.by_configuration:
        return p.configuration or "-"
    na = sum(c.status == "n/a" for c in p.by_configuration[p.configuration])
    return "{} {}/{}".format(p.configuration, *p.configuration_tally(p.configuration)) + (
        f" ({na} n/a)" if na else ""
    )


CONSOLE_MISSES = 3
"""How many of the checks that decide a claim not met the console names (the Markdown and JSON name all)."""
CONSOLE_MESSAGE = 400
"""The console shortens a check's message to this many characters (the Markdown and JSON keep it whole)."""


def _miss(c: Cell) -> str:
    """One check a claim misses, with its number: `orientation: transposed (fail)`, `mix 2.2e+05x the bound`."""
    if c.status == "error":
        return f"{c.check} raised"
    if c.observed is not None:
        return f"{c.check}: {c.observed}"
    if c.ratio is not None and c.max_abs is not None:
        return f"{c.check} {c.ratio:.2g}x the bound ({c.max_abs:.1e})"
    if c.ratio is not None:  # stack-grads: the worst part's gradient norm against the reference's
        return f"{c.check} a gradient {c.severity:.2g}x off ({c.worst})"
    return f"{c.check} {c.status}"


def _claim(p: PeerResult, limit: int | None = None) -> str:
    """The peer's claim and whether it holds: `claims X: met`, or `claims X: NOT met (k/n ...): <the checks that
    fail against X, with their numbers>` (the first `limit` of them); empty without a claim."""
    if p.claims is None:
        return ""
    if p.meets_claim:
        return f"; claims {p.claims}: met"
    name = get_variant(p.claims).name
    passes, of = p.configuration_tally(name)
    misses = p.claim_misses()
    shown = [_miss(c) for c in misses[:limit]]
    if limit is not None and len(misses) > limit:
        shown.append(f"{len(misses) - limit} more")
    why = f": {'; '.join(shown)}" if shown else f": it conforms to {p.configuration} instead"
    return f"; claims {p.claims}: NOT met ({passes}/{of} of its checks pass){why}"


def _short(text: str, limit: int = CONSOLE_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "… (whole in conformance.md)"


_API = "API generation "


def _api(p: PeerResult) -> str:
    """The `API generation ...` part of a tree peer's description (`harness.peers.megatron_lm.TreeApi.line`)."""
    return p.description[p.description.index(_API) :].removesuffix(" (recorded)")


def _determinism(p: PeerResult) -> str:
    """The determinism cell: `bitwise`, each probe's difference, or why there is none."""
    if p.determinism_note is not None:
        return p.determinism_note
    if p.determinism is None:
        return "n/a: no probe check ran"
    return p.determinism.cell()


def format_summary(matrix: Matrix) -> str:
    """One line per peer (best configuration, passes per variant), then every check that did not pass."""
    lines = []
    for p in matrix.peers:
        if p.skipped:
            lines.append(f"{p.peer}: skipped: {p.skipped}")
            continue
        verdict = "conforms to" if p.conforms else "best matches"
        tried = "" if len(p.by_configuration) < 2 else f" [{len(p.by_configuration)} configurations tried]"
        lines.append(
            f"{p.peer} ({p.version or 'no version'}): {verdict} {_configuration(p)}{_claim(p, CONSOLE_MISSES)} "
            f"[per variant: {_scores(p)}]{tried}"
        )
        lines.append(f"    determinism: {_determinism(p)}")
        if _API in p.description:  # a source tree's peer: which API generation the adapter found
            lines.append("    " + _api(p))
        for c in p.cells():
            if c.status != "pass":
                lines.append(f"    {c.check}: {c.status}: {_short(c.message)}")
    return "\n".join(lines)


def markdown(matrix: Matrix) -> str:
    """A `## Conformance` section: the summary table, then per peer every check against its best configuration."""
    md = [
        "## Conformance",
        "",
        "Every peer's ops on the same seeded inputs, outputs and all gradients against the fp64 oracle of each "
        "variant; the best-matching variant per peer, the options of that variant that fit it (its best "
        "configuration), and each check against it (`docs/conformance.md`).",
        "",
        "| peer | version | best variant | passes per variant | best configuration | verdict | determinism |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in matrix.peers:
        if p.skipped:
            md.append(f"| {p.peer} | {p.version or '-'} | - | - | - | skipped: {p.skipped} | - |")
        else:
            md.append(
                f"| {p.peer} | {p.version or '-'} | {p.best} | {_scores(p)} | {_configuration(p)} | "
                f"{'conforms' if p.conforms else 'differs'}{_claim(p).replace('|', chr(92) + '|')} | {_determinism(p)} |"
            )
    for p in matrix.peers:
        if p.skipped:
            continue
        md += [
            "",
            f"### {p.peer} against {p.configuration}",
            "",
            p.description,
            "",
            "| check | result | bound | note |",
            "|---|---|---|---|",
        ]
        for c in p.cells():
            note = (c.message or c.worst).replace("|", "\\|")
            bound = (c.bound or "-").replace("|", "\\|")
            md.append(f"| {c.check} | {_cell_text(c)} | {bound} | {note} |")
    return "\n".join(md) + "\n"


def write_outputs(matrix: Matrix, out_dir: str | Path) -> tuple[Path, Path]:
    """`<out>/conformance.json` and `<out>/conformance.md`, each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "conformance.json", out / "conformance.md")
    for path, text in zip(
        paths, (json.dumps(matrix.to_json(), indent=1) + "\n", markdown(matrix)), strict=True
    ):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return paths


def read_matrix_json(path: str | Path) -> dict:
    """The JSON a conformance run wrote (for reports that embed it)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
