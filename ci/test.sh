#!/usr/bin/env bash
# The test command: lint + every CPU suite through tox, on a fresh machine. Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
# The compat env needs Python 3.12: on a pyenv machine, hand tox the real interpreter (tox queries
# interpreters with a cleaned environment, so pyenv's shims cannot resolve a non-global version).
if [ -z "${MHC_PYTHON312:-}" ] && command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then
        export MHC_PYTHON312="$(pyenv root)/versions/$v/bin/python3.12"
    fi
fi
ENVS=${MHC_TOX_ENVS:-lint,unit,pp,functional,perf,kernels,compat}
start=$(date +%s)
.ci-venv/bin/tox run -e "$ENVS"
echo "ci/test.sh: tox envs $ENVS passed in $(( $(date +%s) - start )) s"
