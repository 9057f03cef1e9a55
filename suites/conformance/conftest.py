"""The conformance suite: every peer's checks (harness.conformance), mutants, the CLI."""

from __future__ import annotations

import pytest

from harness.conformance.matrix import Matrix, run_matrix
from harness.conformance.registry import default_peers
from harness.peers.triton_interpreter import prepare_interpreter

prepare_interpreter()  # at collection, before a test of another suite (torch.compile) can import triton


@pytest.fixture(scope="session")
def matrix() -> Matrix:
    """The default peers' matrix, once per session (a few seconds on CPU)."""
    return run_matrix(default_peers())
