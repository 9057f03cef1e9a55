#!/usr/bin/env bash
# Nightly GPU job (H100 / H200 node): the perf suite against golden/<hw>/perf/ (two-sided band on
# each kernel's median time), then the perf history for this hardware: append, regression check
# against the trailing median, trend plots. Usage: bash ci/nightly_gpu.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MHC_PYTHON:-python3}
HW=$("$PY" -m harness hw | sed -n 1p)
OUT=${MHC_NIGHTLY_OUT:-results/nightly}
HISTORY=${MHC_PERF_HISTORY:-perf-history/${HW}.jsonl}
mkdir -p "$OUT" "$(dirname "$HISTORY")"

# 0. Where each op runs here and why, and the cuTile tuning in force (the benchmarks time every
#    backend directly; this records what a training run on this node would use).
"$PY" -m mhc_core.kernels > "$OUT/backends.txt" 2>&1 || echo "nightly: the preflight reports a problem, see $OUT/backends.txt"
cat "$OUT/backends.txt"

# 1. Benchmarks (never under xdist). MHC_PERF_GOLDEN=1 compares each kernel with its golden band;
#    a first run on new hardware records them: MHC_PERF_GOLDEN=1 ... --update-golden=all
# Inductor compiles in a worker pool here (a GPU node has the cores; the perf conftest's default of
# one in-process compile thread is for 2-core CI boxes).
# With MHC_MEGATRON_LM (a Megatron-LM checkout on the node), upstream's mHC is timed beside ours too
# (suites/perf/test_peers_tree.py); its rows join this night's record and table.
TREE_JSON="$OUT/perf_megatron_lm.json"
rm -f "$TREE_JSON"
MHC_PERF_GOLDEN=${MHC_PERF_GOLDEN:-1} MHC_PERF_CUDA_GRAPH=${MHC_PERF_CUDA_GRAPH:-0} MHC_PERF_TREE_JSON="$TREE_JSON" \
TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8} \
    "$PY" -m pytest -p no:xdist suites/perf --hw "$HW" --benchmark-json="$OUT/perf.json" "$@" || status=$?
also=()
[ -f "$TREE_JSON" ] && also=(--also "$TREE_JSON")

# 2. History, regression check, trend plots, and the table for the README.
"$PY" -m harness perf-history append "$OUT/perf.json" "${also[@]}" --history "$HISTORY" --hw "$HW"
"$PY" -m harness perf-history check --history "$HISTORY" || status=${status:-$?}
"$PY" -m harness perf-history plot --history "$HISTORY" --out "$OUT/trends"
"$PY" -m harness.perf.table "$OUT/perf.json" ${also[1]:+"${also[1]}"} > "$OUT/perf-table.md"
echo "nightly: hardware $HW, table in $OUT/perf-table.md, history $HISTORY"
exit "${status:-0}"
