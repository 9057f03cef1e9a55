#!/usr/bin/env bash
# GPU check of the cuTile kernels: parity tests + a quick timing; results under $OUT.
#
#   PYTHON=.tox/kernels/bin/python bash ci/gpu_check.sh prepare   # here (CPU, network): fill .whl/
#   bash ci/gpu_check.sh           # on the GPU machine (Python 3.12 + torch preinstalled, no network)
#
# What the GPU machine lacks is cuda-tile and a tileiras >= 13.3 (its CUDA is 13.0). The pip
# wheels of cuda-tile[tileiras] are ~200 MB, over a 64 MiB carry, so `prepare` (with a Python that
# has cuda-tile[tileiras], e.g. the `kernels` tox env) writes into .whl/:
#   cuda_tile-1.7.0-cp312-*.whl            (0.4 MB, the Python package)
#   cutile-toolchain-<ver>.tar.xz           (58 MB: bin/tileiras, bin/ptxas, lib/libnvvm.so.4,
#                                            the only pieces tileiras needs, from the pip wheels)
#   cutile-precompiled-sm_90.tar.xz         (~7 MB, what the carry leaves: the kernels the run will launch,
#                                            compiled ahead of time, ci/precompile_cutile.py, docs/cutile.md)
#   megatron_core-0.19.2-cp312-*.whl        (2.4 MB, for the `megatron` step only; not counted above)
#   liger_kernel-0.8.5-*.whl                (0.9 MB: carried, the perf step times Liger as a GPU peer;
#                                            counted against the cache's room)
# Carry the first three by name (carry: [".whl/<each file>"]). The run installs the wheel into
# $TMPDIR/mhc-site (--no-deps: typing-extensions is in the image), unpacks the toolchain into
# $TMPDIR/cutile-ctk and puts it on PATH / CUDA_HOME, where cuda.tile finds it (its pip-wheel lookup
# needs all three nvidia packages; PATH comes next), copies the tree to the precompiled cache's root
# and runs from there with the cache as CUDA_TILE_CACHE_DIR (`precompile check` into env.txt,
# `precompile report`, entries used and kernels still JIT-compiled, into summary.txt).
#
# Steps (MHC_GPU_STEPS, default "parity sweep perf host"; they run in the order below, whatever the order
# named: the sweep first, which writes its checked winners as tuning.json, then every later step
# under that file (MHC_CUTILE_TUNING), so that the parity tests check what would ship and the perf
# suite times it, all in one call; to ship them, copy tuning.json to
# mhc_core/kernels/cutile/tuned/nvidia_h200.json, after which every run on the device uses them
# ("parity" alone then tests them). Each step has its own timeout; the defaults sum to 530 s, under
# the 600 s a device command may run; MHC_GPU_TIMEOUT_<STEP> overrides one, e.g. MHC_GPU_TIMEOUT_PARITY=150):
#   parity  suites/unit/kernels_cutile/test_gpu_parity.py + test_contract.py on 16 xdist workers
#           (the emulated and export tests are CPU CI's), 140 s (317 tests, 99 s on 11-30; the JIT's
#           compiles come from the precompiled cache, except a newly adopted tuning's)
#   bench   python -m tools.cutile.bench at T=8192, C=4096, n=4, bf16, 30 s
#   bench   (not a default step: the sweep's first candidate per key is the default)
#   sweep   python -m tools.cutile.sweep (tile candidates, compiled in parallel, then timed;
#           keys from MHC_SWEEP_KEYS, in sweep_candidates.KEY_ORDER; warm-up one process per key, 60 s, then
#           timing 150 s, each candidate checked against the reference on the same inputs; sweep.json
#           is rewritten after every candidate, so a timeout keeps what was timed; then the fastest
#           per key, --summary, and the winners that passed their check, --adopt -> tuning.json)
#           + precision_probe (fp32 mapping error per MMA mode, 20 s)
#   megatron suites/unit/core + suites/unit/megatron on the GPU (megatron-core 0.19.2 from .whl/; the
#           bf16 optimizer test with fp32-kept mHC params and the CUDA-graph capture tests run only
#           there), 150 s; not a default step
#   functional suites/functional on this GPU (NCCL, one rank: the recipes with an entry for the
#           detected hardware key, `h200` on a lent H200) with --update-golden=all, so a first run records
#           golden/<hw>/functional/ (in gpu_check.tgz); also the determinism, mHC-recompute and
#           fused-ops runs against the reference-ops run. Needs the megatron wheel, 180 s;
#           not a default step
#   compiled suites/unit/kernels without the cuTile params and the `slow` tests: the compiled
#           backend (Inductor / Triton) vs reference on CUDA, its fused dropout, T = 0, dynamic T and
#           the module on top, 4 xdist workers x 4 compile threads, 150 s; not a default step.
#           "compiled megatron functional" sums to 480 s (the defaults: 530 s)
#   conformance  python -m harness conformance: every peer against every variant, the GPU peers
#           (te_triton, tile_kernels: fp32 and bf16 bounds) included where their packages are installed;
#           conformance.txt and conformance/ in gpu_check.tgz, 120 s; not a default step (the carry
#           has no TE / tile-kernels wheels yet: docs/conformance.md)
#   perf    the perf suite (suites/perf: kernels, layer and the peers beside ours, never under xdist) with MHC_PERF_GOLDEN=1 --update-golden=all
#           for reference + cutile (130 s; under this call's tuning.json when the sweep ran), to its own
#           pytest-benchmark JSON; records
#           golden/<hw>/perf/*.json, one perf-history record per JSON, and the Markdown table.
#   perf-compiled  the same for the compiled backend (Inductor/Triton compiles, 110 s); not a default
#           step (its kernels do not change with the cuTile work; h200 goldens exist).
#   host    python -m tools.host_profile --backend cutile at the sweep's shape, 50 calls per op
#           and direction: the host's time per call (device drained, not counted) and a cProfile of it by
#           function and area (mhc_core, torch, cuda.tile, C functions: ct.launch, torch's ops); host.txt,
#           host.json in gpu_check.tgz, one line per op and direction in summary.txt; 30 s
# MHC_GPU_PARITY_K / MHC_GPU_PERF_K: a pytest -k expression that narrows the parity / perf steps (a rerun of
# what failed, or one op's rows), e.g. MHC_GPU_PARITY_K=pre_fused MHC_GPU_PERF_K="pre or layer".
# Output ($OUT, default ./gpu_check_out, at most 8 files come back): summary.txt, env.txt,
# perf-table.md, bench.json, sweep.json, tuning.json and gpu_check.tgz (everything else: parity.txt/.xml, bench.txt,
# megatron.txt/.xml, perf*.json, perf*.txt, host.txt/.json, golden/<hw>/perf/, perf-history.jsonl). To land the figures:
# `tar -xzf gpu_check.tgz` and copy golden/<hw>/perf/ into golden/.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="${WHL:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
SWEEP_SHAPE="--tokens 8192 --hidden 4096 --n 4 --dtype bf16"
CARRY_LIMIT=$((64 * 1024 * 1024))  # what the device tool carries: tree + carried paths

if [[ "${1:-run}" == "prepare" ]]; then
    set -e
    PY="$(realpath -s "$(command -v "$PY")")"  # absolute (the precompile runs elsewhere), venv links kept
    mkdir -p "$WHL"
    pip download --no-deps -d "$WHL" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "cuda-tile==1.7.0"
    pip download --no-deps -d "$WHL" --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "megatron-core==0.19.2"
    # Liger-Kernel (pure Python + Triton, 0.9 MB): the perf step's GPU peer row when carried.
    pip download --no-deps -d "$WHL" --only-binary=:all: "liger-kernel==0.8.5"
    CU13="$("$PY" -c 'import nvidia, pathlib; print(next(p for p in (pathlib.Path(x) / "cu13" for x in nvidia.__path__) if (p / "bin" / "tileiras").is_file()))')"
    VER="$("$CU13/bin/tileiras" --version | sed -n 's/.*V\([0-9][0-9.]*\).*/\1/p' | head -1)"
    if [[ ! -s "$WHL/cutile-toolchain-$VER.tar.xz" ]]; then
        # One xz stream with a dictionary over all 213 MB (the three share code): 57.8 MB, where -9
        # (64 MiB dictionary, what -T0 uses per block) gives 60.0 MB; ~6 min on one core, once.
        STAGE="$(mktemp -d)"
        mkdir -p "$STAGE/bin" "$STAGE/lib"
        cp "$CU13/bin/tileiras" "$CU13/bin/ptxas" "$STAGE/bin/"
        cp "$CU13/lib/libnvvm.so.4" "$STAGE/lib/"
        tar -C "$STAGE" -cf - bin lib | xz -T1 --lzma2=preset=9e,dict=256MiB > "$WHL/cutile-toolchain-$VER.tar.xz.part"
        mv "$WHL/cutile-toolchain-$VER.tar.xz.part" "$WHL/cutile-toolchain-$VER.tar.xz"
        rm -rf "$STAGE"
    fi
    # The precompiled cuTile cache (ci/precompile_cutile.py) fills what the carry leaves: built from
    # a copy of the files that travel, at the path the GPU run then copies the tree to (cuTile's
    # cache keys hold the kernel sources' absolute paths). Not counted: the megatron-core wheel,
    # carried only for the `megatron` step.
    # A fresh directory of this machine's temp space; its path goes into the manifest, and the GPU
    # run creates the same path there.
    PRE_PARENT="$(mktemp -d)"
    PRE_ROOT="${MHC_PRECOMPILE_ROOT:-$PRE_PARENT/mhc-suite}"
    rm -rf "$PRE_ROOT" && mkdir -p "$PRE_ROOT"
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -C "$PRE_ROOT" -xf -
    TREE="$(du -cb --apparent-size "$PRE_ROOT" | tail -1 | cut -f1)"
    CARRIED="$(du -cb "$WHL"/cuda_tile-*cp312*.whl "$WHL"/cutile-toolchain-*.tar.xz "$WHL"/liger_kernel-*.whl | tail -1 | cut -f1)"
    rm -f "$WHL"/cutile-precompiled-*.tar.xz
    # MHC_PRECOMPILE_SETS (e.g. perf,layer,parity) leaves out the sets a planned call will not launch.
    (cd "$PRE_ROOT" && "$PY" ci/precompile_cutile.py --out "$WHL" \
        --max-bytes $((CARRY_LIMIT - TREE - CARRIED - 256 * 1024)) $SWEEP_SHAPE \
        --sets "${MHC_PRECOMPILE_SETS:-sweep,perf,layer,parity,forms}")
    rm -rf "$PRE_ROOT" "$PRE_PARENT"
    ls -la "$WHL"
    du -sh "$WHL"
    exit 0
fi

OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
cd "$ROOT"
status=0
SCRATCH="${TMPDIR:-/tmp}"
SITE="$SCRATCH/mhc-site"
CTK="$SCRATCH/cutile-ctk"

# 0. a precompiled cuTile cache, if carried: run from a copy of the tree at the path it was built
#    for (its manifest's root), so that the JIT finds its entries instead of compiling
PRE_TAR="$(ls "$WHL"/cutile-precompiled-*.tar.xz 2>/dev/null | head -1)"
PRE_DIR="$SCRATCH/cutile-precompiled"
if [[ -n "$PRE_TAR" ]]; then
    rm -rf "$PRE_DIR" && mkdir -p "$PRE_DIR"
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$PRE_TAR" "$PRE_DIR"
    PRE_ROOT="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["root"])' "$PRE_DIR/manifest.json")"
    if [[ -n "$PRE_ROOT" && "$PRE_ROOT" != "$ROOT" ]]; then
        rm -rf "$PRE_ROOT" && mkdir -p "$PRE_ROOT"
        tar -C "$ROOT" --exclude=./.whl --exclude="./${OUT#"$ROOT"/}" -cf - . | tar -C "$PRE_ROOT" -xf -
        ROOT="$PRE_ROOT"
        cd "$ROOT"
    fi
fi

{
    echo "== $(date -u +%FT%TZ) gpu_check"
    # The device's copy of the tree has a HEAD of its own: goldens and history records name the commit
    # the run command gives as MHC_GIT_COMMIT (harness.golden.provenance).
    echo "git_commit: ${MHC_GIT_COMMIT:-unset: recorded as the HEAD of this copy, $(git rev-parse HEAD 2>/dev/null || echo none); put MHC_GIT_COMMIT=<sha> in the run command}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())'
} > "$OUT/env.txt" 2>&1

# 1. install what was carried
mkdir -p "$SITE" "$CTK"
if ! "$PY" -m pip install --no-deps --no-index --target "$SITE" "$WHL"/cuda_tile-*cp312*.whl >> "$OUT/env.txt" 2>&1; then
    echo "gpu_check: installing the cuda_tile wheel from $WHL failed" | tee -a "$OUT/summary.txt"
    exit 1
fi
MCORE_WHL="$(ls "$WHL"/megatron_core-*cp312*.whl 2>/dev/null | head -1)"
if [[ -n "$MCORE_WHL" ]] && ! "$PY" -c 'import megatron.core' 2>/dev/null; then
    "$PY" -m pip install --no-deps --no-index --target "$SITE" "$MCORE_WHL" >> "$OUT/env.txt" 2>&1 \
        || echo "gpu_check: installing $MCORE_WHL failed" | tee -a "$OUT/summary.txt"
fi
LIGER_WHL="$(ls "$WHL"/liger_kernel-*.whl 2>/dev/null | head -1)"
if [[ -n "$LIGER_WHL" ]] && ! "$PY" -c 'import liger_kernel' 2>/dev/null; then
    "$PY" -m pip install --no-deps --no-index --target "$SITE" "$LIGER_WHL" >> "$OUT/env.txt" 2>&1 \
        || echo "gpu_check: installing $LIGER_WHL failed" | tee -a "$OUT/summary.txt"
fi
TARBALL="$(ls "$WHL"/cutile-toolchain-*.tar.xz 2>/dev/null | head -1)"
if [[ -n "$TARBALL" ]]; then
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$TARBALL" "$CTK"
    chmod +x "$CTK"/bin/*
    export PATH="$CTK/bin:$PATH" CUDA_HOME="$CTK" LD_LIBRARY_PATH="$CTK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_TILE_CACHE_DIR="$OUT/.cutile-cache-not-returned"
if [[ -n "$PRE_TAR" ]]; then
    mkdir -p "$CUDA_TILE_CACHE_DIR" && cp "$PRE_DIR/cache.db" "$CUDA_TILE_CACHE_DIR/"
    "$PY" -m tools.cutile.precompile check "$PRE_DIR" >> "$OUT/env.txt" 2>&1
fi
"$PY" - >> "$OUT/env.txt" 2>&1 <<'EOF'
import cuda.tile, mhc_core.kernels.cutile as c
from mhc_core.kernels.cutile.toolchain import find_toolchain
tc = find_toolchain()
print("cuda.tile", cuda.tile.__version__, "| toolchain", tc and (tc.tileiras, tc.version, tc.source))
print("availability", c.availability())
EOF
"$PY" -m mhc_core.kernels >> "$OUT/env.txt" 2>&1  # where each op runs, the cuTile tuning in force
cat "$OUT/env.txt"

STEPS="${MHC_GPU_STEPS:-parity sweep perf host}"
has_step() { [[ " $STEPS " == *" $1 "* ]]; }
limit() {  # limit <step> <default seconds>: MHC_GPU_TIMEOUT_<STEP> or the default
    local var="MHC_GPU_TIMEOUT_${1^^}"
    var="${var//-/_}"
    echo "${!var:-$2}"
}
record() {  # record <step> <exit code>: one line in summary.txt; a failed step fails the script
    echo "$1: exit $2" >> "$OUT/summary.txt"
    [[ $2 -ne 0 ]] && status=1
}

# 2. tile sweep (JIT-compile every candidate in parallel processes, then time them in one) and
#     the fp32 tensor-core precision probe
ADOPTED=""  # set when this call's sweep wrote tuning.json (an $OUT reused from an earlier call may hold one)
if has_step sweep; then
rm -f "$OUT/tuning.json" "$OUT/sweep.json"
SWEEP=(-m tools.cutile.sweep $SWEEP_SHAPE --iters 10)  # ranked by GPU busy time; 10 timed calls suffice
SWEEP_KEYS="${MHC_SWEEP_KEYS:-$("$PY" -c 'from tools.cutile.sweep import CANDIDATES; print(*CANDIDATES)')}"
# One warm-up process per key, all keys at once (14 <= 16 cores): each JIT-compiles its key's
# candidates one after the other into the on-disk cache (one process per candidate, 16 at a time,
# meant ~150 Python + CUDA start-ups for kernels that compile in 0.3-1.1 s each offline on this CPU).
# Each process has its own time limit too, so none outlives the step.
export MHC_SWEEP_PY="$PY" MHC_SWEEP_OUT="$OUT" MHC_SWEEP_LIMIT="$(limit sweep-warm 60)" MHC_SWEEP_SHAPE="$SWEEP_SHAPE"
"$PY" "${SWEEP[@]}" --list | while read -r key idx; do
    if [[ " $SWEEP_KEYS " == *" $key "* ]]; then echo "$key"; fi
done | uniq | timeout "$MHC_SWEEP_LIMIT" xargs -P 16 -L 1 bash -c \
    'timeout "$MHC_SWEEP_LIMIT" "$MHC_SWEEP_PY" -m tools.cutile.sweep $MHC_SWEEP_SHAPE \
     --keys "$0" --warm-only > "$MHC_SWEEP_OUT/sweep-warm-$0.txt" 2>&1'
timeout "$(limit sweep 150)" "$PY" "${SWEEP[@]}" --keys "$(echo $SWEEP_KEYS | tr ' ' ,)" --out "$OUT/sweep.json" \
    > "$OUT/sweep.txt" 2>&1
rc=$?
cat "$OUT/sweep.txt"
record sweep $rc
# the fastest candidate per key, also into sweep.txt; the winners that matched the reference as a
# tuning file (tuning.json: copy it to mhc_core/kernels/cutile/tuned/<device slug>.json to ship it)
if [[ -s "$OUT/sweep.json" ]]; then
    "$PY" "${SWEEP[@]}" --summary "$OUT/sweep.json" 2>&1 | tee -a "$OUT/sweep.txt"
    "$PY" "${SWEEP[@]}" --adopt "$OUT/sweep.json" --out "$OUT/tuning.json" 2>&1 | tee -a "$OUT/sweep.txt"
    rc=${PIPESTATUS[0]}
    record adopt "$rc"
    [[ $rc -eq 0 && -s "$OUT/tuning.json" ]] && ADOPTED=1
    sed -n 's/^wrote /tuning: /p' "$OUT/sweep.txt" >> "$OUT/summary.txt"  # which tuning, where to ship it
fi
timeout "$(limit probe 20)" "$PY" -m tools.cutile.precision_probe --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1
rc=$?
cat "$OUT/probe.txt"
record probe $rc
fi

# The tuning this call's sweep adopted, if any, else what the runtime finds for the device (tuned/):
# every later step (parity, megatron, functional, perf) runs under it, so what would ship is what
# the parity tests check.
if [[ -n "$ADOPTED" && -z "${MHC_CUTILE_TUNING:-}" ]]; then
    export MHC_CUTILE_TUNING="$OUT/tuning.json"
fi
echo "tuning for the later steps: ${MHC_CUTILE_TUNING:-the file shipped for the device, if any} (perf: machine_info.mhc.cutile_tuning in perf.json)" \
    >> "$OUT/summary.txt"

# 3. parity tests (GPU parity + the CPU-side suites of the same directory), after the sweep: under its
#    tuning when it adopted one
if has_step parity; then
timeout "$(limit parity 140)" "$PY" -m pytest -p no:cacheprovider -q -n 16 --junitxml="$OUT/parity.xml" \
    suites/unit/kernels_cutile/test_gpu_parity.py suites/unit/kernels_cutile/test_contract.py ${MHC_GPU_PARITY_K:+-k "$MHC_GPU_PARITY_K"} \
    > "$OUT/parity.txt" 2>&1
rc=$?
tail -5 "$OUT/parity.txt"
record parity $rc
PARITY_FAILED=$((rc != 0))
fi

# 3'. timing at T=8192, C=4096, n=4, bf16
if has_step bench; then
timeout "$(limit bench 30)" "$PY" -m tools.cutile.bench --tokens 8192 --hidden 4096 --n 4 --dtype bf16 \
    --iters 10 --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
rc=$?
cat "$OUT/bench.txt"
record bench $rc
fi

# 3b. the reference core and the megatron integration on the GPU (single process; a world of one,
#     gloo for CPU tensors and NCCL for CUDA ones)
if has_step megatron; then
timeout "$(limit megatron 150)" "$PY" -m pytest -p no:cacheprovider -q -n 4 --junitxml="$OUT/megatron.xml" \
    suites/unit/core suites/unit/megatron > "$OUT/megatron.txt" 2>&1
rc=$?
tail -5 "$OUT/megatron.txt"
record megatron $rc
fi

# 3c. the compiled backend (torch.compile: Triton on the GPU) against the reference on CUDA
if has_step compiled; then
TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-4}" timeout "$(limit compiled 150)" "$PY" -m pytest \
    -p no:cacheprovider -q -n 4 -m "not slow" -k "not cutile" --junitxml="$OUT/compiled.xml" \
    suites/unit/kernels > "$OUT/compiled.txt" 2>&1
rc=$?
tail -5 "$OUT/compiled.txt"
record compiled $rc
fi

HW="$("$PY" -m harness hw | sed -n 1p)"
# The harness plugin comes in through the package's pytest11 entry point when the project is
# installed; here it usually is not (PYTHONPATH only), so load it by name.
PLUGIN=(-p harness.pytest_plugin)
"$PY" -c 'import importlib.metadata as m, sys; sys.exit(any(e.value.startswith("harness.pytest_plugin") for e in m.entry_points(group="pytest11")))' \
    || PLUGIN=()

# 3d. the functional recipes on this GPU (NCCL, one rank), recording this hardware's goldens
if has_step functional; then
timeout "$(limit functional 180)" "$PY" -m pytest -p no:xdist -p no:cacheprovider "${PLUGIN[@]}" suites/functional \
    -q -rs --hw "$HW" --golden-dir "$OUT/golden" --update-golden=all --junitxml="$OUT/functional.xml" \
    > "$OUT/functional.txt" 2>&1
rc=$?
# torchrun runs in its own session: a step timeout kills pytest, not the ranks; no rank may hold the
# GPU into the next step
pkill -f "harness/training/worker.py" 2>/dev/null
tail -8 "$OUT/functional.txt"
record functional $rc
fi

# 3e. the conformance matrix on the GPU: the CPU peers again, and the GPU peers (TransformerEngine's
#     Triton mHC, TileKernels) where their packages are installed (they skip with the reason otherwise)
if has_step conformance; then
timeout "$(limit conformance 120)" "$PY" -m harness conformance --out "$OUT/conformance" \
    > "$OUT/conformance.txt" 2>&1
rc=$?
tail -20 "$OUT/conformance.txt"
record conformance $rc
fi

# 4. the perf suite: roofline ratios, speed-ups, first perf goldens, history record, table
if has_step perf || has_step perf-compiled; then
# After a failed parity step the kernels timed may compute something else: the perf suite still
# runs (its table is in perf-table.md) but records no goldens and no perf-history record.
RECORD=1
if [[ "${PARITY_FAILED:-0}" -eq 1 ]]; then
    RECORD=0
    echo "perf: parity failed in this call, so no perf goldens or history record" >> "$OUT/summary.txt"
fi
perf_run() {  # perf_run <name> <seconds> <-k expression>
    local golden=(--hw "$HW")
    [[ $RECORD -eq 1 ]] && golden+=(--golden-dir "$OUT/golden" --update-golden=all)
    # SIGINT at the limit: pytest stops as on Ctrl-C and still writes the benchmark JSON of what it timed
    # (a SIGTERM left nothing on 12-04); SIGKILL 20 s later if it does not stop.
    MHC_PERF_GOLDEN=$RECORD TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-8}" timeout -s INT -k 20 "$(limit "$1" "$2")" "$PY" -m pytest -p no:xdist -p no:cacheprovider "${PLUGIN[@]}" \
        suites/perf/test_kernels.py suites/perf/test_layer.py suites/perf/test_peers.py -q -k "$3" "${golden[@]}" \
        --benchmark-json="$OUT/$1.json" > "$OUT/$1.txt" 2>&1
    local rc=$?
    tail -3 "$OUT/$1.txt"
    record "$1" $rc
    if [[ -s "$OUT/$1.json" ]]; then
        [[ $RECORD -eq 1 ]] && "$PY" -m harness perf-history append "$OUT/$1.json" --history "$OUT/perf-history.jsonl" \
            --hw "$HW" >> "$OUT/$1.txt" 2>&1
        "$PY" -m harness.perf.table "$OUT/$1.json" >> "$OUT/perf-table.md"
    fi
}
has_step perf && perf_run perf 130 "not compiled${MHC_GPU_PERF_K:+ and ($MHC_GPU_PERF_K)}"
has_step perf-compiled && perf_run perf-compiled 110 "compiled${MHC_GPU_PERF_K:+ and ($MHC_GPU_PERF_K)}"
cat "$OUT/perf-table.md" 2>/dev/null
fi

# 5. the host side of each cuTile op (the per-call time a kernel's GPU time does not explain), after the
#    perf step, whose kernels are then in the JIT cache
if has_step host; then
timeout "$(limit host 30)" "$PY" -m tools.host_profile --backend cutile $SWEEP_SHAPE --calls 50 \
    --out "$OUT/host.json" > "$OUT/host.txt" 2>&1
rc=$?
grep " host " "$OUT/host.txt" | tee -a "$OUT/summary.txt"
record host $rc
fi

[[ -n "$PRE_TAR" ]] && "$PY" -m tools.cutile.precompile report "$PRE_DIR" "$CUDA_TILE_CACHE_DIR" \
    2>&1 | tee -a "$OUT/summary.txt"
rm -rf "$OUT/.cutile-cache-not-returned"
(
    cd "$OUT" || exit 1
    files=()
    for f in *; do  # everything but the files that come back on their own
        case "$f" in summary.txt | env.txt | perf-table.md | bench.json | sweep.json | tuning.json | '*') ;; *) files+=("$f") ;; esac
    done
    if [[ ${#files[@]} -gt 0 ]]; then tar -czf gpu_check.tgz "${files[@]}" && rm -rf "${files[@]}"; fi
)
cat "$OUT/summary.txt"
exit $status
