#!/usr/bin/env bash
# The test command: lint + every CPU suite through tox, on a fresh machine. Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
# pyenv machines: make python3.12 (the compat env) visible next to the default 3.11.
if command -v pyenv >/dev/null 2>&1; then
    PYENV_VERSION="$(pyenv versions --bare | grep -E '^3\.(11|12)\.' | sort -V | awk -F. '!seen[$1"."$2]++' | paste -sd: -)"
    export PYENV_VERSION
fi
ENVS=${MHC_TOX_ENVS:-lint,unit,pp,functional,perf,kernels,compat}
start=$(date +%s)
.ci-venv/bin/tox run -e "$ENVS"
echo "ci/test.sh: tox envs $ENVS passed in $(( $(date +%s) - start )) s"
