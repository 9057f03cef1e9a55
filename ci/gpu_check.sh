#!/usr/bin/env bash
# GPU check of the cuTile kernels: parity tests + a quick timing; results under $OUT.
#
#   bash ci/gpu_check.sh prepare   # here (CPU, network): fill .whl/ with what the GPU box lacks
#   bash ci/gpu_check.sh           # on the GPU machine (Python 3.12 + torch preinstalled, no network)
#
# What the GPU machine lacks is cuda-tile and a tileiras >= 13.3 (its CUDA is 13.0). The pip
# wheels of cuda-tile[tileiras] are ~200 MB, over a 64 MiB carry, so `prepare` carries:
#   .whl/cuda_tile-1.7.0-cp312-*.whl            (0.4 MB, the Python package)
#   .whl/cutile-toolchain-<ver>.tar.xz           (~61 MB: bin/tileiras, bin/ptxas, lib/libnvvm.so.4,
#                                                 the only pieces tileiras needs, from the pip wheels)
# and the run installs the wheel into $TMPDIR/mhc-site (--no-deps: typing-extensions is in the image),
# unpacks the toolchain into $TMPDIR/cutile-ctk and puts it on PATH / CUDA_HOME, where cuda.tile
# finds it (its pip-wheel lookup needs all three nvidia packages; PATH comes next).
#
# Output ($OUT, default ./gpu_check_out): env.txt, parity.txt (pytest), parity.xml (junit),
# bench.txt + bench.json (T=8192, C=4096, n=4, bf16), summary.txt. Budget: under 5 minutes
# (parity tests run on 8 xdist workers: most of their time is the first-launch JIT compiles).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="${WHL:-$ROOT/.whl}"
PY="${PYTHON:-python3}"

if [[ "${1:-run}" == "prepare" ]]; then
    set -e
    mkdir -p "$WHL"
    pip download --no-deps -d "$WHL" --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "cuda-tile==1.7.0"
    CU13="$("$PY" -c 'import nvidia, pathlib; print(next(p for p in (pathlib.Path(x) / "cu13" for x in nvidia.__path__) if (p / "bin" / "tileiras").is_file()))')"
    VER="$("$CU13/bin/tileiras" --version | sed -n 's/.*V\([0-9][0-9.]*\).*/\1/p' | head -1)"
    STAGE="$(mktemp -d)"
    mkdir -p "$STAGE/bin" "$STAGE/lib"
    cp "$CU13/bin/tileiras" "$CU13/bin/ptxas" "$STAGE/bin/"
    cp "$CU13/lib/libnvvm.so.4" "$STAGE/lib/"
    tar -C "$STAGE" -cf - bin lib | xz -T0 -9 > "$WHL/cutile-toolchain-$VER.tar.xz"
    rm -rf "$STAGE"
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

{
    echo "== $(date -u +%FT%TZ) gpu_check"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())'
} > "$OUT/env.txt" 2>&1

# 1. install what was carried
mkdir -p "$SITE" "$CTK"
if ! "$PY" -m pip install --no-deps --no-index --target "$SITE" "$WHL"/cuda_tile-*cp312*.whl >> "$OUT/env.txt" 2>&1; then
    echo "gpu_check: installing the cuda_tile wheel from $WHL failed" | tee -a "$OUT/summary.txt"
    exit 1
fi
TARBALL="$(ls "$WHL"/cutile-toolchain-*.tar.xz 2>/dev/null | head -1)"
if [[ -n "$TARBALL" ]]; then
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$TARBALL" "$CTK"
    chmod +x "$CTK"/bin/*
    export PATH="$CTK/bin:$PATH" CUDA_HOME="$CTK" LD_LIBRARY_PATH="$CTK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_TILE_CACHE_DIR="$OUT/.cutile-cache-not-returned"
"$PY" - >> "$OUT/env.txt" 2>&1 <<'EOF'
import cuda.tile, mhc_core.kernels.cutile as c
from mhc_core.kernels.cutile.toolchain import find_toolchain
tc = find_toolchain()
print("cuda.tile", cuda.tile.__version__, "| toolchain", tc and (tc.tileiras, tc.version, tc.source))
print("availability", c.availability())
EOF
cat "$OUT/env.txt"

# 2. parity tests (GPU parity + the CPU-side suites of the same directory)
timeout 210 "$PY" -m pytest -p no:cacheprovider -q -n 8 --junitxml="$OUT/parity.xml" \
    suites/unit/kernels_cutile -k "not test_compile_cubin" > "$OUT/parity.txt" 2>&1
rc=$?
tail -5 "$OUT/parity.txt"
echo "parity: pytest exit $rc" >> "$OUT/summary.txt"
[[ $rc -ne 0 ]] && status=1

# 3. timing at T=8192, C=4096, n=4, bf16
timeout 75 "$PY" -m mhc_core.kernels.cutile.bench --tokens 8192 --hidden 4096 --n 4 --dtype bf16 \
    --iters 10 --out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
rc=$?
cat "$OUT/bench.txt"
echo "bench: exit $rc" >> "$OUT/summary.txt"
[[ $rc -ne 0 ]] && status=1

rm -rf "$OUT/.cutile-cache-not-returned"
cat "$OUT/summary.txt"
exit $status
