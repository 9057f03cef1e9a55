#!/usr/bin/env bash
# The test command: lint + every CPU suite through tox, on a fresh machine. Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
ENVS=${MHC_TOX_ENVS:-lint,unit,pp,functional,perf}
start=$(date +%s)
.ci-venv/bin/tox run -e "$ENVS"
echo "ci/test.sh: tox envs $ENVS passed in $(( $(date +%s) - start )) s"
