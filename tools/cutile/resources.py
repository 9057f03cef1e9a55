"""What the cuTile compiler made of each kernel, read offline (no GPU): registers, threads per block,
shared memory, spills, the CTAs per SM these allow, and which memory instructions it chose (TMA or
plain loads / stores, shuffles, barriers) among its SASS instructions (`insts`: all of them).

    python -m tools.cutile.resources                 # every n = 4 kernel, sm_90
    python -m tools.cutile.resources --match h_aggregate --arch sm_100
    python -m tools.cutile.resources --sweep --keys sinkhorn,h_post_bda_bwd_occupancy
        # the sweep's candidates at its shape (T 8192, C 4096, n 4, bf16, megatron_dev, 20 iterations),
        # each with the occupancy hint it sets; a legend names each `key[i]`

Each planned launch (`signatures.signature_plan` at n = 4 and C = 512, plus the sweep's
`alternative_plan`) is exported to TileIR bytecode and compiled by `tileiras` with its remarks on;
`cuobjdump` (wheel `nvidia-cuda-cuobjdump`, in the `kernels` extra) reads the cubin's resource
usage and SASS. The first H200 runs showed why this matters: the kernels whose loads became TMA
bulk copies (h_aggregate backward) streamed at ~80 % of copy bandwidth, the ones on plain loads
(the per-stream forwards) at 40-52 %, and Sinkhorn's per-step reductions are lane shuffles.
A static report, not a measurement.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mhc_core.kernels.cutile import toolchain
from tools.cutile.signatures import PlannedLaunch, alternative_plan, signature_plan

__all__ = [
    "KernelResources",
    "ToolFailed",
    "ctas_per_sm",
    "find_cuobjdump",
    "inspect_launch",
    "main",
    "table",
]

_COUNTED = {
    "LDG": "ldg",
    "STG": "stg",
    "UTMALDG": "tma_load",
    "UTMASTG": "tma_store",
    "LDS": "lds",
    "STS": "sts",
    "SHFL": "shfl",
    "BAR": "bar",
    "STL": "stl",
    "LDL": "ldl",
}
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)


@dataclass(frozen=True, kw_only=True)
class KernelResources:
    """One compiled kernel: resource usage, SASS instruction counts, TMA refusals from the remarks."""

    id: str
    arch: str
    registers: int
    threads: int
    shared_bytes: int
    local_bytes: int
    stack_bytes: int
    """The per-thread stack frame (`cuobjdump -res-usage` STACK), where register spills go: the
    SASS then holds `STL` / `LDL` (counted as `stl` / `ldl`); `local_bytes` stays 0 for spills."""
    counts: dict[str, int] = field(default_factory=dict)
    """SASS instructions: `insts` all of them, the others per kind (`_COUNTED`)."""
    tma_refused: tuple[str, ...] = ()
    sass_error: str = ""
    """Why the SASS could not be read (nvdisasm 13.4 rejects some cubins); `counts` is then empty."""

    @property
    def ctas_per_sm(self) -> int:
        """Resident blocks per SM these resources allow (`ctas_per_sm`)."""
        return ctas_per_sm(self.registers, self.threads, self.shared_bytes)


# Per-SM limits of sm_90 and sm_100 (H100 / H200 / B200: the same figures).
_SM_REGS, _SM_THREADS, _SM_BLOCKS, _SM_SMEM, _BLOCK_SMEM_RESERVED = 65536, 2048, 32, 233472, 1024


def ctas_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """Blocks of `threads` threads, `registers` per thread and `shared_bytes` that fit on one
    sm_90 / sm_100 SM (registers are allocated per warp in units of 256; 1 KB of shared memory is
    reserved per block). 0 when one block does not fit."""
    if registers < 1 or threads < 1 or shared_bytes < 0:
        raise ValueError(
            f"ctas_per_sm: registers={registers}, threads={threads}, shared_bytes={shared_bytes}"
        )
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    limits = [_SM_BLOCKS, _SM_THREADS // (warps * 32), (_SM_REGS // per_warp) // warps]
    if shared_bytes:
        limits.append(_SM_SMEM // (shared_bytes + _BLOCK_SMEM_RESERVED))
    return min(limits)


def find_cuobjdump() -> Path:
    """`cuobjdump` next to `tileiras` (the pip wheels) or on PATH; FileNotFoundError naming the wheel."""
    tc = toolchain.find_toolchain()
    for cand in ([tc.bin_dir / "cuobjdump"] if tc else []) + [
        Path(p) for p in [shutil.which("cuobjdump")] if p
    ]:
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        "cuobjdump not found next to tileiras or on PATH "
        "(pip install 'nvidia-cuda-cuobjdump==13.4.92', part of the `kernels` extra)"
    )


def _bytecode(launch: PlannedLaunch, occupancy: int | None = None) -> bytes:
    from tools.cutile.signatures import export_bytecode, kernel_object

    return export_bytecode(
        launch, None if occupancy is None else kernel_object(launch.kernel_name, occupancy)
    )


class ToolFailed(RuntimeError):
    """A cuobjdump run failed; `detail` is the tool's own message."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def _run(cmd: list[str], env: dict[str, str], what: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()[:300]
        raise ToolFailed(
            f"resources: {' '.join(cmd[:2])} failed for {what} (exit {done.returncode}): {detail} "
            "(nvdisasm comes from the wheel nvidia-cuda-nvdisasm==13.4.92, part of the `kernels` extra)",
            detail,
        )
    return done.stdout


def inspect_launch(
    launch: PlannedLaunch, *, arch: str = "sm_90", occupancy: int | None = None
) -> KernelResources:
    """Compile `launch` for `arch` (with the occupancy hint, `ct.kernel(occupancy=...)`, when given)
    and read what the compiler chose."""
    tc = toolchain.find_toolchain()
    if tc is None:
        raise FileNotFoundError("no tileiras found (pip install 'cuda-tile[tileiras]==1.7.0')")
    cuobjdump = find_cuobjdump()
    env = tc.env()
    env["PATH"] = f"{cuobjdump.parent}:{env['PATH']}"  # cuobjdump -sass runs nvdisasm from there
    with tempfile.TemporaryDirectory() as tmp:
        bc, cubin, remarks = Path(tmp, "k.bc"), Path(tmp, "k.cubin"), Path(tmp, "k.yaml")
        bc.write_bytes(_bytecode(launch, occupancy))
        subprocess.run(
            [
                str(tc.tileiras),
                str(bc),
                "-o",
                str(cubin),
                "--gpu-name",
                arch,
                "-O3",
                "--remark-format=yaml",
                "--remarks=all",
                f"--remarks-output-file={remarks}",
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        usage = _run([str(cuobjdump), "-res-usage", str(cubin)], env, launch.id)
        try:
            sass, sass_error = _run([str(cuobjdump), "-sass", str(cubin)], env, launch.id), ""
        except ToolFailed as exc:  # the resource usage above is still right
            sass, sass_error = None, exc.detail[:120]
        elf = _run([str(cuobjdump), "-elf", str(cubin)], env, launch.id)
        refusals = (
            re.findall(
                r"Name:\s+RemarkMemoryTma(?:Load|Store)Failed.*?Reason:\s+'?([^'\n]*)",
                remarks.read_text(),
                re.S,
            )
            if remarks.is_file()
            else []
        )

    def num(key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", usage)
        if m is None:
            raise ValueError(
                f"resources: no {key} in cuobjdump -res-usage output for {launch.id}: {usage[:200]!r}"
            )
        return int(m.group(1))

    ntid = re.search(r"EIATTR_REQNTID\s+Format:\s+\w+\s+Value:\s+0x([0-9a-f]+)", elf)
    if ntid is None:
        raise ValueError(
            f"resources: no EIATTR_REQNTID (threads per block) in cuobjdump -elf output for {launch.id}"
        )
    ops = Counter(_SASS_OP.findall(sass)) if sass is not None else None
    return KernelResources(
        id=launch.id,
        arch=arch,
        registers=num("REG"),
        threads=int(ntid.group(1), 16),
        shared_bytes=num("SHARED"),
        local_bytes=num("LOCAL"),
        stack_bytes=num("STACK"),
        counts=(
            {"insts": sum(ops.values())} | {name: ops.get(op, 0) for op, name in _COUNTED.items()}
            if ops is not None
            else {}
        ),
        sass_error=sass_error,
        tma_refused=tuple(sorted({re.sub(r"^loc\(.*?\):\s*", "", r) for r in refusals})),
    )


def table(rows: list[KernelResources]) -> str:
    """Markdown: one row per kernel."""
    names = ["insts", *_COUNTED.values()]
    out = [
        "| kernel | regs | threads | smem B | local B | stack B | CTAs/SM | "
        + " | ".join(names)
        + " | TMA refused |",
        "|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for r in rows:
        out.append(
            f"| {r.id} | {r.registers} | {r.threads} | {r.shared_bytes} | {r.local_bytes} | {r.stack_bytes} | "
            f"{r.ctas_per_sm} | "
            + " | ".join(str(r.counts.get(n, "?")) for n in names)
            + f" | {'; '.join(r.tma_refused) or '-'}{' (no SASS: ' + r.sass_error + ')' if r.sass_error else ''} |"
        )
    return "\n".join(out)


def _matches(match: str, ident: str) -> bool:
    """Whether launch id `ident` contains `match`, or one of its comma-separated parts."""
    return any(m in ident for m in match.split(","))


def _sweep_plan(args: argparse.Namespace) -> tuple[list[tuple[PlannedLaunch, int | None]], list[str]]:
    """The sweep's launches at its shape with their candidates' occupancy hints, and a legend line
    per candidate (`key[i]: tiles`)."""
    from tools.cutile import precompile
    from tools.cutile.bench import ACT_DTYPES
    from tools.cutile.sweep import CANDIDATES

    keys = [k for k in args.keys.split(",") if k] if args.keys else None
    recorded = precompile.distinct(
        precompile.sweep_launches(
            tokens=args.tokens,
            n=args.n,
            hidden=args.hidden,
            dtype=ACT_DTYPES[args.dtype],
            variant=args.variant,
            iterations=args.iterations,
            keys=keys,
        )
    )
    plan = [
        (PlannedLaunch(id=r.id, kernel_name=r.kernel_name, args=r.args), r.occupancy)
        for r in recorded
        if _matches(args.match, r.id)
    ]
    legend = [
        f"{key}[{i}]: {cand!r}"
        for key, cands in CANDIDATES.items()
        if keys is None or key in keys
        for i, cand in enumerate(cands)
        if any(pl.id.startswith(f"{key}[{i}]-") for pl, _ in plan)
    ]
    return plan, legend


def main(argv: list[str] | None = None) -> int:
    from tools.cutile.bench import add_shape_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90", help="sm_90 (Hopper) or sm_100 (Blackwell)")
    p.add_argument(
        "--match", default="", help="only launch ids containing this (or one of these, comma-separated)"
    )
    p.add_argument(
        "--occupancy",
        type=int,
        help="compile with this occupancy hint (CTAs per SM, 1-32), "
        "as the sweep's *_occupancy candidates (with --sweep: instead of each candidate's)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="the tile sweep's candidates at the shape below "
        "(ids key[i]-kernel) instead of the signature plan at C = 512",
    )
    p.add_argument("--keys", default="", help="with --sweep: only these sweep keys (comma-separated)")
    p.add_argument(
        "--iterations", type=int, default=20, help="with --sweep: Sinkhorn iterations, as the sweep's"
    )
    add_shape_args(p)
    args = p.parse_args(argv)
    if args.occupancy is not None and not 1 <= args.occupancy <= 32:
        p.error(f"--occupancy {args.occupancy}: must be 1-32")
    if args.keys and not args.sweep:
        p.error("--keys goes with --sweep")
    if args.iterations < 1:
        p.error(f"--iterations {args.iterations}: must be >= 1")
    legend: list[str] = []
    if args.sweep:
        try:
            plan, legend = _sweep_plan(args)
        except ValueError as exc:
            p.error(str(exc))
        if args.occupancy is not None:
            plan = [(pl, args.occupancy) for pl, _ in plan]
    else:
        plan = [
            (pl, args.occupancy)
            for pl in signature_plan((4,), cs=(512,)) + alternative_plan()
            if _matches(args.match, pl.id)
        ]
    if not plan:
        p.error(f"--match {args.match!r}: no planned launch id contains it")
    try:
        rows = [inspect_launch(pl, arch=args.arch, occupancy=occ) for pl, occ in plan]
    except FileNotFoundError as exc:
        print(f"resources: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    if legend:
        print("\n" + "\n".join(legend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
