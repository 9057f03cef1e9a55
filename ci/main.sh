#!/usr/bin/env bash
# The main job: the CPU suites against the CPU golden files, with a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
.ci-venv/bin/tox run -e unit -- -q "$@"
