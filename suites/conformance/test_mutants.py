"""Every seeded fault is reported non-conforming by the check that should catch it, and only there."""

from __future__ import annotations

import pytest

from harness.conformance.matrix import Matrix, run_matrix
from suites.conformance.mutants import MUTANTS, Mutant

_MATRICES: dict[str, Matrix] = {}


def _matrix(mutant: Mutant) -> Matrix:
    """The matrix of one mutant, run once for the tests (of this worker) that read it."""
    if mutant.name not in _MATRICES:
        _MATRICES[mutant.name] = run_matrix([mutant])
    return _MATRICES[mutant.name]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.fault.replace(" ", "-") for m in MUTANTS])
def test_mutant_is_caught_by_its_check(mutant):
    """Against the variant it claims (every check, the exit-dependent ones included), the fault's checks fail
    (with numbers) and the untouched ones pass."""
    row = _matrix(mutant).peer(mutant.name)
    cells = row.cells(mutant.variant)
    failing = {c.check for c in cells if c.status == "fail"}
    assert not row.meets_claim
    for prefix in mutant.caught_by:
        hits = [c for c in cells if c.check.startswith(prefix + " ") and c.status == "fail"]
        assert hits, f"{mutant.fault}: no {prefix!r} check failed; failing: {sorted(failing)}"
        assert all(c.message for c in hits)  # each names the tensor, the error and the bound
    for prefix in mutant.spared:
        touched = [c.check for c in cells if c.check.startswith(prefix) and c.status != "pass"]
        assert not touched, f"{mutant.fault}: checks it does not touch failed: {touched}"


@pytest.mark.parametrize(
    ("fault", "configuration"),
    [
        ("norm eps inside the square root", "megatron_main+eps_inside_sqrt"),
        ("residual mix untransposed", "megatron_dev+untransposed_mix"),
    ],
)
def test_a_fault_that_is_a_named_option_is_named(fault, configuration):
    """A fault that is an option is named: the matrix reports the configuration the mutant computes, which
    it conforms to, and says it is not the one it claims."""
    from harness.conformance.report import format_summary

    (mutant,) = (m for m in MUTANTS if m.fault == fault)
    matrix = _matrix(mutant)
    row = matrix.peer(mutant.name)
    assert row.configuration == configuration and row.conforms and not row.meets_claim
    passes, of = row.configuration_tally(configuration)
    assert passes == of
    assert f"conforms to {configuration} {passes}/{of}; claims {mutant.claims}: NOT met (" in format_summary(
        matrix
    ), format_summary(matrix)


@pytest.mark.parametrize(
    "mutant",
    [
        m
        for m in MUTANTS
        if m.fault
        in (
            "Sinkhorn ends on a row pass",
            "bias pre/post halves swapped",
            "H_post without its factor 2",
            "gradient detached before Sinkhorn",
            "streams collapsed every layer",
        )
    ],
    ids=lambda m: m.fault.replace(" ", "-"),
)
def test_a_fault_that_is_no_option_conforms_to_nothing(mutant):
    """The other faults match no variant and no configuration."""
    assert not _matrix(mutant).peer(mutant.name).conforms


def test_the_unmutated_core_passes_every_check():
    """The same adapter without a fault conforms to each variant: the catches are the faults'."""
    from harness.peers.mhc_core_peer import mhc_core_peers

    for row in run_matrix(mhc_core_peers()).peers:
        assert row.meets_claim and row.configuration == row.claims, [
            c.message for c in row.cells() if c.status != "pass"
        ]


def test_collapsed_streams_starve_the_residual_mix_of_gradient():
    """The collapse mutant's `stack-grads` names the H_res parameters: with n equal copies entering every
    layer, the gradient reaching them is orders of magnitude below the reference's."""
    (mutant,) = (m for m in MUTANTS if m.fault == "streams collapsed every layer")
    row = _matrix(mutant).peer(mutant.name)
    (cell,) = (c for c in row.cells(mutant.variant) if c.check == "stack-grads n4 fp64")
    assert cell.status == "fail" and "alpha_res" in cell.message and "[res]" in cell.message, cell.message
    assert cell.ratio is not None and cell.ratio < 1 / 1000, cell


def test_console_markdown_and_json_print_the_same_counts_and_the_claim():
    """One count everywhere: the configuration's passes over all its checks and the per-variant passes over the
    variant's checks are the same in the console line, the markdown table and the JSON; a claim not met is in
    the console line and the markdown, with the claim's own count."""
    from harness.conformance.report import format_summary, markdown

    (mutant,) = (m for m in MUTANTS if m.fault == "norm eps inside the square root")
    matrix = _matrix(mutant)
    row, doc = matrix.peer(mutant.name), matrix.to_json()["peers"][0]
    cfg = row.configuration
    passes, of = row.configuration_tally(cfg)
    assert doc["configuration_scores"][cfg] == {"pass": passes, "of": of} and passes == of
    line = format_summary(matrix).splitlines()[0]
    table = next(x for x in markdown(matrix).splitlines() if x.startswith(f"| {mutant.name} |"))
    for v in ("paper", "megatron_main", "megatron_dev"):
        p, o = row.tally(v)
        assert doc["scores"][v] == {"pass": p, "of": o} and o == len(row.by_variant[v])
        assert f"{v} {p}/{o}" in line and f"{v} {p}/{o}" in table
    claimed = doc["configuration_scores"][mutant.claims]
    assert claimed["pass"] < claimed["of"] and doc["claim"]["claims"] == mutant.claims
    assert doc["claim"]["met"] is False
    want = f"claims {mutant.claims}: NOT met ({claimed['pass']}/{claimed['of']} of its checks pass): "
    assert want in line and want in table, (line, table)


def test_a_claim_not_met_names_the_checks_that_decide_it():
    """A claim not met says why: the failing checks against the claimed configuration with their numbers,
    orientation first where it fails; the console names the first three and counts the rest, the markdown and the
    JSON name them all."""
    from harness.conformance.report import CONSOLE_MISSES, format_summary, markdown

    (mutant,) = (m for m in MUTANTS if m.fault == "residual mix untransposed")
    matrix = _matrix(mutant)
    row, doc = matrix.peer(mutant.name), matrix.to_json()["peers"][0]
    misses = row.claim_misses()
    failing = {c.check for c in row.cells(mutant.claims) if c.status in ("fail", "error")}
    assert {c.check for c in misses} == failing, ([c.check for c in misses], failing)
    assert misses[0].check.startswith("orientation ") and len(misses) > CONSOLE_MISSES, [
        c.check for c in misses
    ]
    severities = [c.severity for c in misses if not c.check.startswith("orientation ")]
    assert severities == sorted(severities, reverse=True)
    assert [c["check"] for c in doc["claim"]["misses"]] == [c.check for c in misses]
    line = format_summary(matrix).splitlines()[0]
    why = line.split(": NOT met (", 1)[1].split("): ", 1)[1]
    assert why.startswith(f"{misses[0].check}: {misses[0].observed}"), line
    assert f"{len(misses) - CONSOLE_MISSES} more" in why and misses[CONSOLE_MISSES].check not in why, line
    numeric = next(c for c in misses if c.max_abs is not None)
    assert f"{numeric.check} {numeric.ratio:.2g}x the bound ({numeric.max_abs:.1e})" in why, line
    table = next(x for x in markdown(matrix).splitlines() if x.startswith(f"| {mutant.name} |"))
    assert all(c.check in table for c in misses) and " more" not in table, table


def test_stack_grads_names_every_part_that_is_off():
    """`stack-grads` names every parameter part whose gradient is off (worst first), not the first few."""
    import torch

    from harness.conformance.checks import GradSize, _specs_for
    from harness.conformance.matrix import _grad_size_cell

    (spec,) = (s for s in _specs_for(4, torch.float64) if s.kind == "grad_sizes" and s.op == "stack")
    sizes = [
        GradSize(name=f"layer{i}.attn.weight[res]", peer=10.0 ** -(i + 2), reference=1.0) for i in range(6)
    ]
    sizes.append(GradSize(name="layer0.attn.alpha_pre", peer=1.0, reference=1.0))
    cell = _grad_size_cell(spec, "megatron_dev", sizes)
    listed = cell.message.split("norm): ", 1)[1].split(", ")
    assert cell.status == "fail" and cell.message.startswith("6 of 7 parameter parts"), cell.message
    assert [x.split(" ")[0] for x in listed] == [f"layer{i}.attn.weight[res]" for i in reversed(range(6))]
