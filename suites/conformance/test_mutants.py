"""Every seeded fault is reported non-conforming by the check that should catch it, and only there."""

from __future__ import annotations

import pytest

from harness.conformance.matrix import run_matrix
from suites.conformance.mutants import MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.fault.replace(" ", "-") for m in MUTANTS])
def test_mutant_is_caught_by_its_check(mutant):
    """Against the variant it claims, the fault's checks fail (with numbers) and the untouched ones pass."""
    row = run_matrix([mutant]).peer(mutant.name)
    cells = row.by_variant[mutant.variant]
    failing = {c.check for c in cells if c.status == "fail"}
    assert not row.meets_claim
    for prefix in mutant.caught_by:
        hits = [c for c in cells if c.check.startswith(prefix + " ") and c.status == "fail"]
        assert hits, f"{mutant.fault}: no {prefix!r} check failed; failing: {sorted(failing)}"
        assert all(c.message for c in hits)  # each names the tensor, the error and the bound
    for prefix in mutant.spared:
        touched = [c.check for c in cells if c.check.startswith(prefix) and c.status != "pass"]
        assert not touched, f"{mutant.fault}: checks it does not touch failed: {touched}"


def test_a_fault_that_is_a_named_option_is_named():
    """The eps moved inside the square root is an option: the matrix names the configuration the mutant
    computes (megatron_main+eps_inside_sqrt), which it conforms to, and says it is not the one it claims."""
    from harness.conformance.report import format_summary

    (mutant,) = (m for m in MUTANTS if m.fault == "norm eps inside the square root")
    matrix = run_matrix([mutant])
    row = matrix.peer(mutant.name)
    assert row.configuration == "megatron_main+eps_inside_sqrt" and row.conforms and not row.meets_claim
    assert "conforms to megatron_main+eps_inside_sqrt, not its claim megatron_main" in format_summary(matrix)


def test_the_unmutated_core_passes_every_check():
    """The same adapter without a fault conforms to each variant: the catches are the faults'."""
    from harness.peers.mhc_core_peer import mhc_core_peers

    for row in run_matrix(mhc_core_peers()).peers:
        assert row.meets_claim and row.configuration == row.claims, \
            [c.message for c in row.cells() if c.status != "pass"]
