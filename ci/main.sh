#!/usr/bin/env bash
# The main job: the CPU suites (unit, pp, functional) through the harness, against golden/<hw>/,
# with a summary table, JUnit XML and results/report.md (plots under results/plots/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/bootstrap.sh
.ci-venv/bin/tox run -e harness -- "$@"
