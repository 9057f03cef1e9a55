"""`mhc-harness`: hw, run, recalibrate, diff, import-megatron, import-log, conformance, trainserve, perf-history {append,check,plot}.

Exit codes: 0 success; 1 a failure (test, golden mismatch, regression, differing files for
`diff`) or a refused input (any `GoldenError`: malformed or non-finite
file, unknown hardware key, failed recalibration run; a file that is missing, a directory or not
writable); 2 bad usage (arguments, unknown suite).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.golden.errors import GoldenError

__all__ = ["build_parser", "main"]


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds > 0")
    return value


def _split_pytest_args(text: str) -> list[str]:
    import shlex

    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--pytest-args {text!r}: {exc}") from None


def _cmd_hw(args: argparse.Namespace) -> int:
    from harness.golden.fingerprint import current_fingerprint
    from harness.golden.hardware import detect_hardware

    hw = detect_hardware(override=args.hw)
    fp = current_fingerprint()
    print(hw.key)
    print(f"rule: {hw.rule}")
    print(f"known: {'yes' if hw.known else 'no (recalibration needs --allow-unknown-hw)'}")
    print(f"numerics fingerprint: {fp.label}")
    for k, v in fp.to_json().items():
        if v not in (None, [], {}):
            print(f"  {k}: {', '.join(v) if isinstance(v, list) else v}")
    print("  (this process's; a functional CPU run pins its ISA first, see docs/functional.md)")
    return 0


def _dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    suites_dir = Path(args.suites_dir).resolve()
    golden_dir = Path(args.golden_dir).resolve() if args.golden_dir else suites_dir.parent / "golden"
    return suites_dir, golden_dir


def _cmd_run(args: argparse.Namespace) -> int:
    from harness.report import format_table, summary_rows, write_report
    from harness.runner import run_suites

    suites_dir, golden_dir = _dirs(args)
    suite_args: dict[str, list[str]] = {}
    for item in args.suite_args:
        suite, sep, rest = item.partition("=")
        if not sep or not suite:
            raise ValueError(f"--suite-args {item!r}: expected SUITE=ARGS, e.g. unit='-n 2'")
        suite_args.setdefault(suite, []).extend(_split_pytest_args(rest))
    if (
        args.megatron_lm
    ):  # the pp and functional suites run the tree beside ours (harness.upstream.megatron_tree)
        os.environ["MHC_MEGATRON_LM"] = str(Path(args.megatron_lm).resolve())
    for stale in ("conformance.json", "conformance.md"):  # report.md embeds only this run's matrix
        (Path(args.out) / stale).unlink(missing_ok=True)
    summary = run_suites(
        args.suites,
        suites_dir=suites_dir,
        out_dir=args.out,
        golden_dir=golden_dir,
        hw=args.hw,
        pytest_args=_split_pytest_args(args.pytest_args),
        timeout_s=args.timeout,
        suite_args=suite_args,
        out=lambda line: print(line, flush=True),
    )
    for r in summary.runs:
        print(
            f"{r.suite}: pytest exit {r.returncode}, {r.tests} tests, {r.failures} failures, {r.errors} errors, "
            f"{r.skipped} skipped"
        )
        if not r.ok:
            print(r.output_tail[-2000:])
    if args.conformance:
        _conformance(args, Path(args.out))
    rows = summary_rows(summary.cases)
    print(format_table(rows) if rows else "no golden cases were checked")
    for o in summary.cases:
        if o.lane_reason:
            print(f"{o.suite}/{o.case}: decided by the {o.lane} lane; {o.lane_reason}")
    for o in summary.cases:
        if o.failed:
            print(f"\n{o.suite}/{o.case} {o.status}:\n{o.message}")
    report = write_report(summary, args.out, plots=not args.no_plots)
    print(f"\nreport: {report}\nJUnit: {', '.join(str(r.junit) for r in summary.runs)}")
    print("PASS" if summary.ok else "FAIL")
    return 0 if summary.ok else 1


def _conformance(args: argparse.Namespace, out_dir: Path):
    """Run the conformance matrix for `args` (peers, tree), write it under `out_dir`; the matrix."""
    from harness.conformance.matrix import run_matrix
    from harness.conformance.registry import select
    from harness.conformance.report import format_summary, write_outputs

    tree = Path(args.megatron_lm) if args.megatron_lm else None
    peers = select(
        list(args.peer),
        tree,
        python=args.megatron_lm_python,
        modules=args.peer_module,
        transformer_engine=_path(args.transformer_engine),
        torchtitan=_path(args.torchtitan),
    )
    matrix = run_matrix(peers)
    print(format_summary(matrix))
    js, md = write_outputs(matrix, out_dir)
    print(f"conformance: {js}, {md}")
    if getattr(args, "save_matrix", None):
        from harness.conformance.saved import save_matrix

        save_matrix(matrix, Path(args.save_matrix), [p.name for p in peers])
        print(f"conformance: matrix kept for the conformance suite in {args.save_matrix}")
    return matrix


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _cmd_conformance(args: argparse.Namespace) -> int:
    matrix = _conformance(args, Path(args.out))
    if args.strict:
        bad = [p.peer for p in matrix.peers if not p.skipped and not p.conforms]
        if bad:
            print(f"--strict: {', '.join(bad)} do not conform to any variant or configuration on every check")
            return 1
    return 0


def _cmd_trainserve(args: argparse.Namespace) -> int:
    """The train/serve mismatch of the serving peers (harness.conformance.trainserve); exit 1 when one fails."""
    from harness.peers.triton_interpreter import prepare_interpreter

    prepare_interpreter()  # before anything imports triton
    from harness.conformance.trainserve import TrainServeSetup, measure, serving_peers
    from harness.conformance.trainserve_report import verdict, write_trainserve
    from mhc_core.forms import ConnectionForm

    try:
        depths = tuple(int(d) for d in args.depths.split(","))
        setups = [
            TrainServeSetup(depths=depths, tokens=args.tokens, hidden=args.hidden, form=form)
            for form in ConnectionForm
        ]
    except ValueError as exc:
        print(
            f"error: --depths {args.depths!r} / --tokens {args.tokens} / --hidden {args.hidden}: {exc}",
            file=sys.stderr,
        )
        return 2
    passed = True
    for setup in setups:  # the per-sublayer form (DeepSeek-V4), then the single-pass one (DeepSeek-V4.1)
        candidates = serving_peers(setup.form)
        peers = [p for p in candidates if not args.peer or p.name in args.peer]
        for p in peers:
            why = p.unavailable()
            if why:
                print(f"trainserve: {p.name} skipped: {why}")
        rows = measure(peers, setup)
        paths = write_trainserve(rows, setup, Path(args.out))
        for r in rows[1:]:
            print(f"trainserve ({setup.form}): {r.name}: {verdict(r, rows[0])}")
        print(f"trainserve ({setup.form}): {', '.join(map(str, paths))}")
        passed = passed and all(r.passed for r in rows)
    return 0 if passed else 1


def _cmd_recalibrate(args: argparse.Namespace) -> int:
    from harness.golden.hardware import detect_hardware, require_known
    from harness.golden.recalibrate import recalibrate
    from harness.golden.store import GoldenStore
    from harness.runner import pytest_case_runner

    hw = detect_hardware(override=args.hw)
    print(f"hardware key: {hw.key} ({hw.rule})")
    require_known(hw.key, allow_unknown=args.allow_unknown_hw)
    suites_dir, golden_dir = _dirs(args)
    runner = pytest_case_runner(
        args.suite,
        args.case,
        suites_dir=suites_dir,
        golden_dir=golden_dir,
        hw=hw.key,
        pytest_args=_split_pytest_args(args.pytest_args),
        timeout_s=args.timeout,
    )
    if args.exact_only and args.only_failing:
        raise ValueError("--exact-only and --only-failing are exclusive")
    recalibrate(
        store=GoldenStore(golden_dir),
        hw=hw,
        suite=args.suite,
        case=args.case,
        runner=runner,
        repeats=args.repeats,
        only_failing=args.only_failing,
        allow_unknown_hw=args.allow_unknown_hw,
        dry_run=args.dry_run,
        commit_cwd=suites_dir.parent,
        exact_only=args.exact_only,
    )
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from harness.golden.bands import DEFAULT_BANDS, drift
    from harness.golden.recalibrate import mean_relative_change
    from harness.golden.schema import load_golden

    a = load_golden(args.a, allow_nan_strings=args.allow_nan_strings)
    b = load_golden(args.b, allow_nan_strings=args.allow_nan_strings)
    print(f"A = {args.a}\nB = {args.b}")
    differ = False
    rows = {r.metric: r for r in drift(a, b, DEFAULT_BANDS)}
    worst = None
    for m in [*a, *(k for k in b if k not in a)]:
        if m not in b or m not in a:
            print(f"  {m}: only in {'A' if m in a else 'B'}")
            differ = True
            continue
        mr, mx, n = mean_relative_change(a[m], b[m])
        r = rows[m]
        differ |= bool(mx or r.only_a or r.only_b)
        mr_s = "n/a" if mr is None else f"{mr:+.6e}"
        where = f" at step {r.worst_step}" if r.worst_step is not None else ""
        rel = "" if r.max_rel is None else f", max |A-B|/|A| = {r.max_rel:.3e}"
        band = (
            "no default band"
            if r.band is None
            else f"{r.outside} step(s) outside the default band {r.band.describe()}"
        )
        print(
            f"  {m}: mean((A-B)/A) = {mr_s}, max |A-B| = {mx:.6g}{rel}{where} over {n} common steps; {band}; "
            f"steps only in A: {list(r.only_a) or 'none'}; only in B: {list(r.only_b) or 'none'}"
        )
        if r.worst_step is not None and (worst is None or (r.max_rel or 0) > (worst.max_rel or 0)):
            worst = r
    if worst is not None:
        print(
            f"worst: {worst.metric!r} at step {worst.worst_step} (|A-B|/|A| = "
            f"{'n/a' if worst.max_rel is None else f'{worst.max_rel:.3e}'})"
        )
    outside = sum(r.outside or 0 for r in rows.values())
    print(f"{outside} step(s) outside the default bands ({', '.join(sorted(DEFAULT_BANDS))})")
    print("files differ" if differ else "identical values")
    return 1 if differ else 0


def _cmd_import(args: argparse.Namespace) -> int:
    from harness.golden.errors import MissingGoldenError
    from harness.golden.hardware import require_known, validate_hw_key
    from harness.golden.recalibrate import change_lines
    from harness.golden.schema import golden_from_doc, parse_json, read_text
    from harness.golden.store import GoldenStore, build_meta

    key = require_known(validate_hw_key(args.hw, field="--hw"), allow_unknown=args.allow_unknown_hw)
    raw = parse_json(
        read_text(args.file), source=args.file
    )  # parsed once: the golden, and the values it drops
    golden = golden_from_doc(raw, source=args.file, allow_nan_strings=True)
    store = GoldenStore(args.golden_dir)
    try:
        old, _ = store.load(key, args.suite, args.case)
    except MissingGoldenError:
        old = None
    meta = build_meta(
        hw=key,
        suite=args.suite,
        case=args.case,
        golden=golden,
        source=f"import-megatron {Path(args.file).name}",
        repeats=1,
    )
    # Where the values come from (the versions and commit above are the importing machine's, not the recording's).
    meta["imported"] = {
        "file": args.upstream_path or Path(args.file).name,
        "file_sha256": hashlib.sha256(Path(args.file).read_bytes()).hexdigest(),
        "upstream_commit": args.upstream_commit,
    }
    if old is not None:
        print(f"replacing the existing {args.suite}/{args.case} on {key}:")
        print("\n".join(change_lines(old, golden)))
    f = store.write(key, args.suite, args.case, golden, meta)
    for m, s in golden.items():
        values = raw[m].get("values", {}) if isinstance(raw.get(m), dict) else {}
        dropped = sum(isinstance(v, str) for v in values.values())
        note = f"; dropped {dropped} 'nan' step(s)" if dropped else ""
        print(f"  {m}: {len(s.values)} steps ({s.start_step}..{s.end_step} every {s.step_interval}){note}")
    print(f"wrote {f.json}")
    return 0


def _cmd_import_log(args: argparse.Namespace) -> int:
    from harness.golden.megatron_log import read_log
    from harness.golden.schema import dumps_golden

    golden = read_log(args.log)
    if args.metric:
        missing = [m for m in args.metric if m not in golden]
        if missing:
            raise ValueError(
                f"{args.log}: no {', '.join(map(repr, missing))} in the log (it has: {', '.join(golden)})"
            )
        golden = {m: golden[m] for m in args.metric}
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(dumps_golden(golden, target=str(out)), encoding="utf-8")
    tmp.replace(out)
    for m, ser in golden.items():
        print(f"  {m}: {len(ser.values)} steps ({ser.start_step}..{ser.end_step})")
    print(f"wrote {out}")
    return 0


def _cmd_perf(args: argparse.Namespace) -> int:
    from harness.perf import history as ph
    from harness.perf import peer_trend

    if args.perf_cmd == "append":
        from harness.golden.hardware import detect_hardware
        from harness.golden.schema import parse_json

        src = Path(args.benchmark_json)
        doc = parse_json(src.read_text(encoding="utf-8"), source=str(src))
        machine = doc.get("machine_info") if isinstance(doc, dict) else None
        from harness.golden.hardware import validate_hw_key

        hw = validate_hw_key(
            args.hw or (machine or {}).get("mhc_hw") or detect_hardware().key,
            field="--hw" if args.hw else "machine_info.mhc_hw",
        )
        versions = (machine or {}).get("mhc_versions")
        if args.also:  # benchmarks of the same run written apart (the upstream tree's rows)
            merged = list(ph.benchmark_list(doc, source=str(src)))
            for extra in args.also:
                more = parse_json(Path(extra).read_text(encoding="utf-8"), source=extra)
                merged += ph.benchmark_list(more, source=extra)
            doc = {**doc, "benchmarks": merged}
        rec = ph.record_from_benchmark_json(
            doc,
            source=str(src),
            hw=hw,
            commit=args.commit,
            versions=versions if isinstance(versions, dict) else None,
        )
        ph.append_record(args.history, rec)
        print(
            f"appended {len(rec['benchmarks'])} benchmarks ({hw}, commit {rec['commit']}) to {args.history}"
        )
        return 0
    records = ph.read_history(args.history)
    if args.perf_cmd == "check":
        verdicts = ph.check_history(
            records, window=args.window, band_slow=args.band_slow, band_fast=args.band_fast
        )
        print(ph.format_verdicts(verdicts))
        peers = peer_trend.check_peers(records, window=args.window, band=args.peer_band)
        if peers:
            print("ours against the peers (same-run ratios):")
            print(peer_trend.format_peer_verdicts(peers))
        bad = {"regression"} | ({"improved"} if args.fail_on_improvement else set())
        return (
            1
            if any(v.status in bad for v in verdicts) or any(v.status == "fell_behind" for v in peers)
            else 0
        )
    from harness.perf.page import write_pages

    pngs = ph.plot_history(records, args.out) + peer_trend.plot_peers(records, args.out)
    for p in [*pngs, *write_pages(records, pngs, args.out)]:
        print(f"wrote {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mhc-harness`."""
    p = argparse.ArgumentParser(prog="mhc-harness", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("hw", help="print the hardware key and the rule that chose it")
    s.add_argument("--hw", help="override (else $MHC_HW, else detection)")
    s.set_defaults(func=_cmd_hw)

    def peer_options(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--peer",
            action="append",
            default=[],
            metavar="NAME",
            help="a peer to check (repeatable; default: all but the compiled mhc_core ones)",
        )
        s.add_argument(
            "--megatron-lm",
            default=os.environ.get("MHC_MEGATRON_LM"),
            metavar="PATH",
            help="a Megatron-LM source tree (main or dev): a conformance peer megatron_lm_tree[...]; "
            "under `run`, also trained by the pp and functional suites beside ours "
            "(default: $MHC_MEGATRON_LM)",
        )
        s.add_argument(
            "--peer-module",
            action="append",
            default=[],
            metavar="MODULE:NAME",
            help="your own peer: a Peer instance, subclass or factory in an importable module "
            "(repeatable; the current directory is on the path; docs/conformance.md)",
        )
        s.add_argument(
            "--megatron-lm-python",
            default=None,
            metavar="PYTHON",
            help="the interpreter that loads the tree (it imports triton; default: this one)",
        )
        s.add_argument(
            "--transformer-engine",
            default=os.environ.get("MHC_TRANSFORMER_ENGINE"),
            metavar="PATH",
            help="a TransformerEngine source tree: its Triton mHC as the peer te_triton, interpreted "
            "without a GPU (default: $MHC_TRANSFORMER_ENGINE)",
        )
        s.add_argument(
            "--torchtitan",
            default=os.environ.get("MHC_TORCHTITAN"),
            metavar="PATH",
            help="a torchtitan source tree with models/deepseek_v4: the peer torchtitan "
            "(default: $MHC_TORCHTITAN)",
        )

    def dirs(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--suites-dir", default="suites", help="directory holding the suites (default: ./suites)"
        )
        s.add_argument("--golden-dir", help="golden store (default: <suites-dir>/../golden)")
        s.add_argument("--hw", help="hardware key (else $MHC_HW, else detection)")
        s.add_argument("--pytest-args", default="", help="extra pytest arguments, one shell-quoted string")
        s.add_argument(
            "--timeout", type=_positive_seconds, default=None, help="seconds per pytest subprocess"
        )

    s = sub.add_parser("run", help="run suites through pytest, compare, report")
    s.add_argument("suites", nargs="*", metavar="SUITE", help="suite names (default: all under --suites-dir)")
    dirs(s)
    s.add_argument("--out", default="results", help="report directory (default: ./results)")
    s.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    s.add_argument(
        "--suite-args",
        action="append",
        default=[],
        metavar="SUITE=ARGS",
        help="extra pytest arguments for one suite, one shell-quoted string (repeatable), "
        "e.g. unit='-n 2 --ignore=suites/unit/kernels'",
    )
    s.add_argument(
        "--conformance",
        action="store_true",
        help="also run the conformance matrix (the default peers) into the summary and report.md",
    )
    peer_options(s)
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser("conformance", help="every mHC implementation against every variant: the matrix")
    peer_options(s)
    s.add_argument(
        "--out",
        default="results",
        help="writes conformance.json and conformance.md here (default: ./results)",
    )
    s.add_argument(
        "--save-matrix",
        default=None,
        metavar="PATH",
        help="also keep the computed matrix at PATH for the conformance suite (its fixture loads it when "
        "$MHC_CONFORMANCE_MATRIX names it and it matches the checkout)",
    )
    s.add_argument(
        "--strict", action="store_true", help="exit 1 when an available peer does not conform fully"
    )
    s.set_defaults(func=_cmd_conformance)

    s = sub.add_parser("trainserve", help="the serving engines' mHC against the trainer's, by depth")
    s.add_argument(
        "--out",
        default="results",
        help="writes trainserve.{json,md,png} and trainserve-single-pass.{json,md,png} here (default: ./results)",
    )
    s.add_argument("--depths", default="1,8,32,61", help="the depths reported (default 1,8,32,61)")
    s.add_argument(
        "--tokens", type=int, default=64, help="tokens per run, the batch of the invariance check (64)"
    )
    s.add_argument("--hidden", type=int, default=64, help="stream width C (n*C a multiple of 64; default 64)")
    s.add_argument("--peer", action="append", default=[], help="only this serving peer (repeatable)")
    s.set_defaults(func=_cmd_trainserve)

    s = sub.add_parser("recalibrate", help="run a case N times and rewrite its golden values")
    s.add_argument("suite")
    s.add_argument("case")
    s.add_argument("--repeats", type=int, default=5, help="runs to average (default 5)")
    s.add_argument(
        "--only-failing", action="store_true", help="rewrite only if the current golden file fails"
    )
    s.add_argument(
        "--allow-unknown-hw", action="store_true", help="allow a hardware key outside the known list"
    )
    s.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    s.add_argument(
        "--exact-only",
        action="store_true",
        help="add this machine's exact values (its numerics fingerprint) beside the reference; the "
        "reference and other machines' exact values stay",
    )
    dirs(s)
    s.set_defaults(func=_cmd_recalibrate)

    s = sub.add_parser("diff", help="compare two golden or result files")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--allow-nan-strings", action="store_true", help="accept legacy 'nan' strings (dropped)")
    s.set_defaults(func=_cmd_diff)

    s = sub.add_parser("import-megatron", help="import a Megatron golden_values_*.json as a case")
    s.add_argument("file")
    s.add_argument("suite")
    s.add_argument("case")
    s.add_argument("--hw", required=True)
    s.add_argument("--golden-dir", default="golden")
    s.add_argument("--allow-unknown-hw", action="store_true")
    s.add_argument(
        "--upstream-commit", default=None, help="the commit of the tree the file comes from (provenance)"
    )
    s.add_argument("--upstream-path", default=None, help="the file's path in that tree (provenance)")
    s.set_defaults(func=_cmd_import)

    s = sub.add_parser(
        "import-log",
        help="a Megatron training log (stdout, or a TensorBoard log directory) as a "
        "result file (golden schema)",
    )
    s.add_argument("log", help="a text log, a TensorBoard log directory or an events.out.tfevents.* file")
    s.add_argument("--out", required=True, help="the result file to write (e.g. results/my_run.json)")
    s.add_argument("--metric", action="append", default=[], help="keep only these metrics (repeatable)")
    s.set_defaults(func=_cmd_import_log)

    s = sub.add_parser("perf-history", help="append / check / plot the perf history")
    ps = s.add_subparsers(dest="perf_cmd", required=True)
    a = ps.add_parser("append", help="append a pytest-benchmark JSON file as one record")
    a.add_argument("benchmark_json")
    a.add_argument("--history", required=True, help="JSONL history file")
    a.add_argument("--hw", help="hardware key (else machine_info.mhc_hw, else detection)")
    a.add_argument("--commit", help="commit (else commit_info.id)")
    a.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="JSON",
        help="another benchmark file of the same run, merged into the record (repeatable)",
    )
    c = ps.add_parser("check", help="newest record against the trailing median")
    c.add_argument("--history", required=True)
    c.add_argument("--window", type=int, default=5, help="previous records in the baseline (default 5)")
    c.add_argument("--band-slow", type=float, default=0.10, help="regression band (default 0.10)")
    c.add_argument("--band-fast", type=float, default=0.20, help="improvement band (default 0.20)")
    c.add_argument("--fail-on-improvement", action="store_true")
    c.add_argument(
        "--peer-band",
        type=float,
        default=0.10,
        help="how far our same-run speed-up over a peer may drop below its baseline (default 0.10)",
    )
    pl = ps.add_parser(
        "plot",
        help="one trend PNG per hardware and benchmark group, and a summary page (<hw>.md) per hardware",
    )
    pl.add_argument("--history", required=True)
    pl.add_argument("--out", required=True)
    s.set_defaults(func=_cmd_perf)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `mhc-harness`; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GoldenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file that is missing, a directory, read-only, ...: refused input, not usage
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        print(f"error: {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
