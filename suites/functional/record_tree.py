"""Record a Megatron-LM tree's training of the functional recipes (numbers, not code).

    python -m suites.functional.record_tree --megatron-lm /path/to/Megatron-LM [--case gpt_tp2_pp2_mhc] \\
        [--hw cpu_x86_64] [--out-dir suites/functional/recorded]

For each case: our model writes its initial weights (`tree_diff.dump_init`), the tree trains the recipe
from them (`tree_diff.run_tree`) and its per-step metrics are written to
`<out-dir>/megatron_lm_<branch>-<case>.json` with where they came from: repository, branch, commit
(the checkout's, else `$MHC_MEGATRON_LM_COMMIT`), the sha256 of the tree's mHC files, of the recipe and
of the initial weights, torch, Python, the command. `test_tree_recorded.py` replays every recording
against our integration on every CI run; a recipe edited since fails there, naming this command.
Run it with a Python that imports the tree (the `tree` extra: triton).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

from harness.golden.provenance import utc_now
from harness.upstream.megatron_tree import TreeError, hashes, tree_under_test
from suites.functional import tree_diff
from suites.functional.tree_recording import FORMAT

__all__ = ["RECORDED_DIR", "main", "recording_path"]
RECORDED_DIR = Path(__file__).with_name("recorded")


def recording_path(out_dir: Path, branch: str, case: str) -> Path:
    return Path(out_dir) / f"megatron_lm_{branch}-{case}.json"


def command(case: str, hw: str) -> str:
    """The command that re-records `case` (placeholders for this machine's paths)."""
    return (
        f"python -m suites.functional.record_tree --megatron-lm <tree> --case {shlex.quote(case)} "
        f"--hw {shlex.quote(hw)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM source tree (dev or main)")
    p.add_argument(
        "--case", action="append", default=None, help=f"recipe (repeatable; default {tree_diff.CASES})"
    )
    p.add_argument("--hw", default="cpu_x86_64", help="hardware key of the recipe entry (default cpu_x86_64)")
    p.add_argument("--out-dir", type=Path, default=RECORDED_DIR, help="where the recordings go")
    args = p.parse_args(argv)
    import torch

    try:
        tree = tree_under_test(args.megatron_lm)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for case in args.case or tree_diff.CASES:
        reason = tree_diff.skip_reason(case, args.hw, tree.flavor)
        if reason:
            print(f"not recorded: {tree.label}: {reason}")
            continue
        with tempfile.TemporaryDirectory(prefix="mhc-record-tree-") as tmp:
            work, data = Path(tmp), Path(tmp) / "data"
            init = tree_diff.dump_init(case, args.hw, tree.flavor, work_dir=work / "init", data_dir=data)
            run = tree_diff.run_tree(case, args.hw, tree, init, work_dir=work / "tree", data_dir=data)
            doc = {
                "format": FORMAT,
                "case": case,
                "hw": args.hw,
                "source": {
                    "repository": "NVIDIA/Megatron-LM",
                    "branch": tree.flavor,
                    "commit": tree.commit,
                    "files_sha256": hashes(tree.path),
                    "recorded": utc_now(),
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "command": command(case, args.hw),
                    "seconds": round(run.seconds, 1),
                },
                "recipe_sha256": tree_diff.recipe_sha256(case),
                "init_sha256": tree_diff.file_sha256(init),
                "our_numerics": dict(tree_diff.OUR_NUMERICS[tree.flavor]),
                "metrics": tree_diff.as_json(
                    {m: run.metrics[m] for m in tree_diff.METRICS if m in run.metrics}
                ),
            }
        out = recording_path(args.out_dir, tree.flavor, case)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp_out.write_text(tree_diff.dumps(doc), encoding="utf-8")
        tmp_out.replace(out)
        print(f"recorded {tree.label} training {case} ({run.seconds:.0f} s) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
