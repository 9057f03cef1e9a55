#!/usr/bin/env bash
# Create .ci-venv with tox (the only tool installed outside the project's own tox envs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MHC_PYTHON:-python3.11}
if [ ! -x .ci-venv/bin/tox ]; then
    "$PY" -m venv .ci-venv
    .ci-venv/bin/pip install -q --disable-pip-version-check "tox>=4.30,<5"
fi
