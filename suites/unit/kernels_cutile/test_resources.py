"""The offline resource report (`mhc_core.kernels.cutile.resources`): compile, read, tabulate."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.tile", reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')")

from mhc_core.kernels.cutile import resources, toolchain  # noqa: E402
from mhc_core.kernels.cutile.signatures import signature_plan  # noqa: E402


@pytest.fixture(scope="module")
def tools():
    if toolchain.find_toolchain() is None:
        pytest.skip("no tileiras compiler found (pip wheels of cuda-tile[tileiras], PATH or $CUDA_HOME/bin)")
    try:
        resources.find_cuobjdump()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("ident", ["h_aggregate-fwd-n4-bf16-main", "h_aggregate-bwd-n4-bf16-main"])
def test_report_reads_registers_and_memory_instructions(tools, ident):
    """A compiled kernel reports 1-255 registers and at least one load and one store (plain or TMA)."""
    launch = next(p for p in signature_plan() if p.id == ident)
    r = resources.inspect_launch(launch, arch="sm_90")
    assert 1 <= r.registers <= 255 and r.shared_bytes >= 0 and r.local_bytes >= 0, r
    assert r.counts["ldg"] + r.counts["tma_load"] >= 1, r
    assert r.counts["stg"] + r.counts["tma_store"] >= 1, r
    rows = resources.table([r]).splitlines()
    assert rows[0].startswith("| kernel | regs |") and rows[2].startswith(f"| {ident} | {r.registers} |")


def test_missing_cuobjdump_names_the_wheel(monkeypatch):
    """Without cuobjdump the error says which wheel brings it."""
    monkeypatch.setattr(toolchain, "find_toolchain", lambda: None)
    monkeypatch.setattr(resources.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-cuobjdump"):
        resources.find_cuobjdump()
