"""A committed recording of a Megatron-LM tree's training (`record_tree.py`), read and checked against
the current recipes before anything is launched."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from suites.functional import tree_diff

__all__ = ["TreeRecording", "load_recording"]

FORMAT = "mhc-suite training recording 1"


@dataclass(frozen=True, kw_only=True)
class TreeRecording:
    """One recording: the case, the hardware key, where it came from, and the tree's metrics per step."""

    path: Path
    case: str
    hw: str
    branch: str
    source: dict[str, Any]
    init_sha256: str
    metrics: dict[str, dict[int, float]]

    @property
    def label(self) -> str:
        commit = self.source.get("commit")
        return f"{self.branch}@{commit[:12]}" if commit else f"{self.branch} (no commit)"


def load_recording(path: Path) -> TreeRecording:
    """The recording at `path`; `ValueError` naming the file for one that is malformed, and naming the
    command that re-records it when its recipe or our numerics changed since."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable training recording: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: not a training recording (format {got!r}, expected {FORMAT!r})")
    missing = [
        k
        for k in ("case", "hw", "source", "recipe_sha256", "init_sha256", "our_numerics", "metrics")
        if k not in doc
    ]
    if missing:
        raise ValueError(f"{path}: a training recording without {', '.join(missing)}")
    source, case = doc["source"], doc["case"]
    how = f"re-record with: {source.get('command', 'python -m suites.functional.record_tree')}"
    if not (tree_diff.RECIPE_DIR / f"{case}.yaml").is_file():
        raise ValueError(f"{path}: recipe {case!r} no longer exists; drop the recording or {how}")
    if doc["recipe_sha256"] != tree_diff.recipe_sha256(case):
        raise ValueError(
            f"{path}: recipes/{case}.yaml changed since the recording ({source.get('recorded', '?')}); {how}"
        )
    branch = source.get("branch")
    if branch not in tree_diff.OUR_NUMERICS or doc["our_numerics"] != dict(tree_diff.OUR_NUMERICS[branch]):
        raise ValueError(
            f"{path}: recorded against our numerics {doc['our_numerics']}, now "
            f"{dict(tree_diff.OUR_NUMERICS.get(branch, {}))} for {branch!r}; {how}"
        )
    metrics = tree_diff.from_json(doc["metrics"])
    if not metrics.get("lm loss"):
        raise ValueError(f"{path}: the recording has no lm loss steps")
    return TreeRecording(
        path=path,
        case=case,
        hw=doc["hw"],
        branch=branch,
        source=source,
        init_sha256=doc["init_sha256"],
        metrics=metrics,
    )
