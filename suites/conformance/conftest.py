"""The conformance suite: every peer's checks (harness.conformance), mutants, the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.conformance.matrix import Matrix, run_matrix
from harness.conformance.registry import default_peers
from harness.conformance.saved import ENV_VAR, load_matrix
from harness.peers.triton_interpreter import prepare_interpreter

prepare_interpreter()  # at collection, before a test of another suite (torch.compile) can import triton


@pytest.fixture(scope="session")
def matrix() -> Matrix:
    """The default peers' matrix, once per session (about 40 s on 2 cores); the one `mhc-harness conformance
    --save-matrix` kept where `$MHC_CONFORMANCE_MATRIX` names it, if it was computed from this checkout."""
    peers = default_peers()
    where = os.environ.get(ENV_VAR)
    saved = load_matrix(Path(where), [p.name for p in peers]) if where else None
    return saved if saved is not None else run_matrix(peers)
