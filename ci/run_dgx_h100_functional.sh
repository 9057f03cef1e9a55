#!/usr/bin/env bash
# Functional suite on one DGX H100 node (8 GPUs, NCCL): recalibrate golden/dgx_h100/functional/
# from the recipes' dgx_h100 entries, then run the whole suite against the files just written.
#
#   bash ci/run_dgx_h100_functional.sh               # recalibrate (first run on a node) + check
#   bash ci/run_dgx_h100_functional.sh check         # check only: compare with the committed files
#   bash ci/run_dgx_h100_functional.sh recalibrate gpt3_mcore_tp2_pp2_mhc   # one case
#
# Needs: 8 visible GPUs (CUDA_VISIBLE_DEVICES unset or listing 8), the project installed with its
# test extra and megatron-core, and transformer-engine for gpt3_mcore_tp2_pp2_mhc
# (--transformer-impl transformer_engine, bf16, sequence parallel). No network is used.
#
# Env: PYTHON (python3), MHC_HW (dgx_h100), REPEATS (2: identical repeats keep the exact lane),
#      OUT (results/functional-$MHC_HW: report.md, plots, JUnit, per-case actual values),
#      TIMEOUT (3600 s per pytest subprocess).
# Afterwards review `git diff golden/` and commit golden/dgx_h100/functional/*.json + *.meta.json.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
HW="${MHC_HW:-dgx_h100}"
REPEATS="${REPEATS:-2}"
OUT="${OUT:-$ROOT/results/functional-$HW}"
TIMEOUT="${TIMEOUT:-3600}"
MODE="${1:-all}"
shift || true
cd "$ROOT"
export MHC_HW="$HW" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONHASHSEED=0 MPLBACKEND=Agg

echo "== $(date -u +%FT%TZ) functional suite on $HW ($MODE)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
"$PY" - "$HW" <<'EOF'
import sys

import torch

hw = sys.argv[1]
n = torch.cuda.device_count()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {n} visible GPU(s)")
if n < 8:
    sys.exit(f"run_dgx_h100_functional.sh: {hw} recipes need 8 GPUs, {n} visible")
import megatron.core  # noqa: F401  (fails loudly when megatron-core is missing)

try:
    import transformer_engine  # noqa: F401
except ImportError:
    print("warning: transformer_engine is not importable: gpt3_mcore_tp2_pp2_mhc will fail")
EOF

# Every recipe with a HARDWARE entry for $HW (or the cases named on the command line).
if [[ $# -gt 0 ]]; then
    CASES="$*"
else
    # Read from the recipe files themselves (data); the suite validates them when it runs.
    CASES="$("$PY" -c "
import pathlib, yaml
recipes = sorted(pathlib.Path('harness/training/recipes').glob('*.yaml'))
print(' '.join(p.stem for p in recipes if '$HW' in (yaml.safe_load(p.read_text()).get('HARDWARE') or {})))
")"
fi
echo "cases: $CASES"

status=0
if [[ "$MODE" == "all" || "$MODE" == "recalibrate" ]]; then
    for case in $CASES; do
        echo "== recalibrate functional/$case on $HW ($REPEATS repeats)"
        "$PY" -m harness recalibrate functional "$case" --repeats "$REPEATS" --hw "$HW" --timeout "$TIMEOUT" \
            --pytest-args "-p no:xdist" || status=1
    done
fi
if [[ "$MODE" == "all" || "$MODE" == "check" ]]; then
    echo "== check: the whole functional suite against golden/$HW/functional (report under $OUT)"
    "$PY" -m harness run functional --hw "$HW" --out "$OUT" --timeout "$TIMEOUT" --pytest-args "-p no:xdist -ra" \
        || status=1
fi
echo "== run_dgx_h100_functional.sh: exit $status; golden files:"
ls -la "golden/$HW/functional" 2>/dev/null || echo "(none written)"
exit "$status"
