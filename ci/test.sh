#!/usr/bin/env bash
# The test command: lint + every CPU suite through tox, on a fresh machine. Exit non-zero on any failure.
#
# Two lanes, so that a 2-core machine is kept busy: the `compat` and `kernels` envs (each with its
# own environment and no tox package build, so nothing is shared with the other lane) run in the
# background, in that order, then `conformance` and `typecheck` (in the shared CPU env, long installed by then),
# while the other CPU envs run in the foreground. compat goes first: its
# download of the CUDA torch wheel needs little CPU and overlaps the foreground, and the kernels
# env, which keeps both cores busy, is the tail. Their output goes to .tox/ci-side.log and is
# printed when they finish. The perf env's figures from such a run are a smoke run, not a
# measurement (run `tox -e perf` alone for those). MHC_CI_SERIAL=1 runs everything in one lane.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
# A fresh run installs about 11 GiB (compat's env with the CUDA torch wheel alone 4.8 GiB); say so up front
# when the disk is short, since pip's "No space left on device" names neither the need nor the env.
NEED_GIB=${MHC_CI_NEED_GIB:-13}
free_gib=$(df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
echo "ci/test.sh: ${free_gib} GiB free on $(df -P . | awk 'NR == 2 { print $6 }'), a fresh run needs about ${NEED_GIB}"
if [ "$free_gib" -lt "$NEED_GIB" ]; then
    echo "ci/test.sh: WARNING: only ${free_gib} GiB free, below the ~${NEED_GIB} GiB a fresh run needs (11 GiB measured per fresh clone: .tox/compat ~5.5 with JAX, .tox/cpu ~3.5 with the serving wheels, .tox/kernels ~1.6; the rest for pip's temporary files); installs may fail with ENOSPC" >&2
fi
# The compat env needs Python 3.12: on a pyenv machine, hand tox the real interpreter (tox queries
# interpreters with a cleaned environment, so pyenv's shims cannot resolve a non-global version).
if [ -z "${MHC_PYTHON312:-}" ] && command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then
        export MHC_PYTHON312="$(pyenv root)/versions/$v/bin/python3.12"
    fi
fi
ENVS=${MHC_TOX_ENVS:-lint,unit,pp,functional,perf,conformance,typecheck,kernels,compat}
# The perf env here is a smoke run beside the other lane (its figures are no measurement): two timed
# repetitions per benchmark instead of five, the kernel cases over 1024 tokens at 4 Sinkhorn iterations (suites/perf/test_kernels.py),
# and the peers at T 256, C 512 with one compiled peer op (suites/perf/peers.py), keep CI's wall time down
# (`tox -e perf` alone measures).
export MHC_PERF_REPS="${MHC_PERF_REPS:-2}" MHC_PERF_SMOKE="${MHC_PERF_SMOKE:-1}"
SIDE_ENVS=(compat kernels)
# conformance (shared .tox/cpu, which the foreground's first env installs) follows kernels in the side lane,
# which by then has run for minutes: with the kernels env's compile time cut, the foreground was the longer
# lane (measured on a 2-core Zen 4 box, cold caches: 953 s against 956 s with perf there, 1217 s with perf here).
# typecheck (mypy, cold: about 40 s) follows it there since the single-pass cases made the foreground the longer
# lane again (pp +14 s, functional +71 s measured alone; it had moved to the foreground when the pp suite's launches
# were batched and the side lane was the longer: 853 s against about 800 s, fresh clone, cold caches).
if [[ ",$ENVS," == *",kernels,"* ]]; then SIDE_ENVS+=(conformance typecheck); fi
main=() side=()
IFS=, read -ra requested <<< "$ENVS"
for e in "${requested[@]}"; do
    if [ "${MHC_CI_SERIAL:-0}" = 1 ] || [[ " ${SIDE_ENVS[*]} " != *" $e "* ]]; then main+=("$e"); fi
done
if [ "${MHC_CI_SERIAL:-0}" != 1 ]; then
    for e in "${SIDE_ENVS[@]}"; do
        if [[ ",$ENVS," == *",$e,"* ]]; then side+=("$e"); fi
    done
fi
join() { local IFS=,; echo "$*"; }

start=$(date +%s)
side_pid="" side_log=.tox/ci-side.log
if [ ${#side[@]} -gt 0 ]; then
    mkdir -p .tox
    # Its own session, so that an interrupted run takes the whole lane (tox, pytest, its workers) down.
    setsid .ci-venv/bin/tox run -e "$(join "${side[@]}")" > "$side_log" 2>&1 &
    side_pid=$!
    trap '[ -n "$side_pid" ] && kill -- -"$side_pid" 2>/dev/null || true' EXIT
    echo "ci/test.sh: $(join "${side[@]}") running beside the other envs (output: $side_log, printed when done)"
fi
main_rc=0
if [ ${#main[@]} -gt 0 ]; then
    .ci-venv/bin/tox run -e "$(join "${main[@]}")" || main_rc=$?
fi
side_rc=0
if [ -n "$side_pid" ]; then
    wait "$side_pid" || side_rc=$?
    side_pid=""
    echo "===== ci/test.sh: output of $(join "${side[@]}") (exit $side_rc) ====="
    cat "$side_log"
fi
took=$(( $(date +%s) - start ))
if [ "$main_rc" -ne 0 ] || [ "$side_rc" -ne 0 ]; then
    echo "ci/test.sh: FAILED in $took s (exit $main_rc for ${main[*]:-nothing}, $side_rc for ${side[*]:-nothing})"
    exit 1
fi
echo "ci/test.sh: tox envs $ENVS passed in $took s"
