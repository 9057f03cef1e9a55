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


@pytest.mark.parametrize(("fault", "configuration"), [
    ("norm eps inside the square root", "megatron_main+eps_inside_sqrt"),
    ("residual mix untransposed", "megatron_dev+untransposed_mix")])
def test_a_fault_that_is_a_named_option_is_named(fault, configuration):
    """A fault that is an option is named: the matrix reports the configuration the mutant computes, which
    it conforms to, and says it is not the one it claims."""
    from harness.conformance.report import format_summary

    (mutant,) = (m for m in MUTANTS if m.fault == fault)
    matrix = run_matrix([mutant])
    row = matrix.peer(mutant.name)
    assert row.configuration == configuration and row.conforms and not row.meets_claim
    assert f"conforms to {configuration}, not its claim {mutant.claims}" in format_summary(matrix)


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.fault in (
    "Sinkhorn ends on a row pass", "bias pre/post halves swapped", "H_post without its factor 2",
    "gradient detached before Sinkhorn")], ids=lambda m: m.fault.replace(" ", "-"))
def test_a_fault_that_is_no_option_conforms_to_nothing(mutant):
    """The other faults match no variant and no configuration."""
    assert not run_matrix([mutant]).peer(mutant.name).conforms


def test_the_unmutated_core_passes_every_check():
    """The same adapter without a fault conforms to each variant: the catches are the faults'."""
    from harness.peers.mhc_core_peer import mhc_core_peers

    for row in run_matrix(mhc_core_peers()).peers:
        assert row.meets_claim and row.configuration == row.claims, \
            [c.message for c in row.cells() if c.status != "pass"]
