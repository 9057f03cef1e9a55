"""Measure a functional case under several CPU numerics profiles, and under deliberate changes.

The approximate lane's bands (`harness.golden.bands`) must hold wherever only the numerics differ and
fail where the model or the schedule changed. This records the evidence: one run per profile
(`harness/training/numerics.py`) and one per change (a MODEL_ARGS override), each as a golden-
schema file with its numerics fingerprint, and prints how far each is from the first profile::

    python -m suites.functional.drift gpt_tp1_pp1_mhc --out docs/measurements/cpu-numerics-drift \\
        --profiles avx2 baseline native --change variant:--mhc-variant=megatron_dev \\
        --change warmup:--lr-warmup-iters=3

Writes `<out>/<case>/<profile>.json` / `change-<name>.json` (+ `.fingerprint.json`) and
prints (and writes to `<out>/<case>/drift.txt`), per metric, the largest relative and absolute difference, its step, and the steps outside
the default band. Nothing here writes to `golden/`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

from harness.golden.bands import DEFAULT_BANDS, drift, format_drift
from harness.golden.hardware import detect_hardware
from harness.golden.schema import dumps_golden, load_golden, to_golden
from harness.launch.runs import run_case
from harness.training.numerics import CpuNumerics

__all__ = ["main", "parse_change"]


def parse_change(text: str) -> tuple[str, dict[str, object]]:
    """`name:--flag=value[,--flag=value]` -> `(name, {flag: value})`; values parse as YAML scalars."""
    name, sep, rest = text.partition(":")
    if not sep or not name or not rest:
        raise ValueError(f"--change {text!r}: expected name:--flag=value[,--flag=value]")
    out: dict[str, object] = {}
    for item in rest.split(","):
        flag, eq, value = item.partition("=")
        if not eq or not flag.startswith("--"):
            raise ValueError(f"--change {text!r}: {item!r} is not --flag=value")
        out[flag] = yaml.safe_load(value)
    return name, out


def _save(run, path: Path) -> None:
    path.write_text(dumps_golden(to_golden(run.metrics), target=str(path)), encoding="utf-8")
    path.with_suffix(".fingerprint.json").write_text(
        json.dumps(run.fingerprint, indent=1) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--profiles",
        nargs="+",
        default=[c.value for c in CpuNumerics],
        choices=[c.value for c in CpuNumerics],
        help="the first one is the reference",
    )
    p.add_argument("--change", action="append", default=[], type=parse_change, metavar="NAME:--FLAG=VALUE")
    p.add_argument(
        "--base",
        type=parse_change,
        default=None,
        metavar="NAME:--FLAG=VALUE",
        help="overrides for every run (the runs go to <out>/<case>+<NAME>/)",
    )
    p.add_argument("--hw", default=None)
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite drift.txt from the files already in <out>/<case>/",
    )
    args = p.parse_args(argv)
    hw = detect_hardware(override=args.hw).key
    base_name, base = args.base or ("", {})
    out = args.out / (args.case + (f"+{base_name}" if base_name else ""))
    out.mkdir(parents=True, exist_ok=True)
    runs = [(prof, dict(base), CpuNumerics(prof), out / f"{prof}.json") for prof in args.profiles]
    runs += [
        (f"change-{name}", {**base, **ov}, CpuNumerics(args.profiles[0]), out / f"change-{name}.json")
        for name, ov in args.change
    ]
    if args.report_only:
        runs = runs[:1] + sorted(
            (
                (p.stem, {}, CpuNumerics(args.profiles[0]), p)
                for p in out.glob("*.json")
                if not p.name.endswith(".fingerprint.json") and p != runs[0][3]
            ),
            key=lambda r: r[0],
        )
    with tempfile.TemporaryDirectory(prefix="mhc-drift-") as tmp:
        for tag, overrides, profile, path in [] if args.report_only else runs:
            run = run_case(
                args.case,
                hw,
                work_dir=Path(tmp) / tag,
                data_dir=Path(tmp) / "data",
                overrides=overrides or None,
                numerics=profile,
            )
            _save(run, path)
    reference = load_golden(runs[0][3])
    report = []
    for tag, _, _, path in runs[1:]:
        report += [
            f"{out.name}: {tag} against {runs[0][0]}",
            format_drift(drift(reference, load_golden(path), DEFAULT_BANDS)),
            "",
        ]
    (out / "drift.txt").write_text("\n".join(report), encoding="utf-8")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
