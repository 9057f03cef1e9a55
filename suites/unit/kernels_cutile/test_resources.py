"""The offline resource report (`tools.cutile.resources`): compile, read, tabulate."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "cuda.tile", reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')"
)

from mhc_core.kernels.cutile import tiling, toolchain  # noqa: E402
from tools.cutile import resources  # noqa: E402
from tools.cutile.signatures import signature_plan  # noqa: E402


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
    assert 32 <= r.threads <= 1024 and r.threads % 32 == 0 and r.ctas_per_sm >= 1, r
    assert r.counts["ldg"] + r.counts["tma_load"] >= 1, r
    assert r.counts["stg"] + r.counts["tma_store"] >= 1, r
    assert r.counts["insts"] > sum(v for k, v in r.counts.items() if k != "insts"), r
    rows = resources.table([r]).splitlines()
    assert rows[0].startswith(
        "| kernel | regs | threads | smem B | local B | stack B | CTAs/SM | insts | ldg |"
    )
    assert rows[2].startswith(
        f"| {ident} | {r.registers} | {r.threads} | {r.shared_bytes} | {r.local_bytes} | "
        f"{r.stack_bytes} | {r.ctas_per_sm} |"
    )


@pytest.mark.slow
def test_report_shows_register_spills(tools):
    """Spills are reported: the mapping backward's dx/dW kernel at 32 x 128 tokens x K (the 11-29
    default) compiles with a stack frame on sm_90 and STL / LDL in its SASS, the 16 x 64 tile
    without any (a kernel that only ever reported `local B` showed 0 for both)."""
    from tools.cutile import signatures

    def dx_dw(tiles):
        plan = signatures.plan_under({"mapping_bwd": tiles})
        launch = next(p for p in plan if p.id == "mapping-bwd-n4-bf16-main-dx_dw")
        return resources.inspect_launch(launch, arch="sm_90")

    spilling, clean = dx_dw(tiling.MappingTiles(32, 128)), dx_dw(tiling.MappingTiles(16, 64))
    assert spilling.stack_bytes > 0 and spilling.counts["stl"] > 0 and spilling.counts["ldl"] > 0, spilling
    assert clean.stack_bytes == 0 and clean.counts["stl"] == 0 and clean.counts["ldl"] == 0, clean


@pytest.mark.slow
def test_unreadable_sass_keeps_the_resource_usage(tools, monkeypatch):
    """When nvdisasm rejects a cubin (13.4 does for some), the row keeps registers and threads and says why."""
    real = resources._run

    def failing_sass(cmd, env, what):
        if "-sass" in cmd:
            raise resources.ToolFailed(
                f"resources: cuobjdump -sass failed for {what} (exit 1)", "nvdisasm error   : Opclass 'nop_'"
            )
        return real(cmd, env, what)

    monkeypatch.setattr(resources, "_run", failing_sass)
    launch = next(p for p in signature_plan() if p.id == "h_aggregate-fwd-n4-bf16-main")
    r = resources.inspect_launch(launch, arch="sm_90")
    assert (
        r.registers >= 1
        and r.threads >= 32
        and r.counts == {}
        and r.sass_error == "nvdisasm error   : Opclass 'nop_'"
    )
    assert "| ? |" in resources.table([r]) and "(no SASS: nvdisasm error" in resources.table([r])


@pytest.mark.slow
def test_occupancy_hint_caps_registers(tools):
    """The occupancy hint reaches the compiler: at 4 CTAs per SM the kernel fits 4 blocks (fewer registers)."""
    launch = next(p for p in signature_plan() if p.id == "h_aggregate-bwd-n4-bf16-main")
    free, hinted = (resources.inspect_launch(launch, arch="sm_90", occupancy=o) for o in (None, 4))
    assert hinted.ctas_per_sm >= 4 and hinted.registers < free.registers, (free, hinted)


@pytest.mark.parametrize(
    ("regs", "threads", "smem", "ctas"),
    [
        (255, 256, 0, 1),  # 64 Ki registers: one block of 8 warps at 255 (256 per thread allocated)
        (64, 256, 0, 4),
        (92, 128, 0, 5),  # 92 -> 96 per thread: 21 warps of registers, 4 warps per block
        (40, 128, 0, 12),
        (32, 128, 100_000, 2),  # shared memory: 228 KB per SM, 1 KB reserved per block
        (16, 32, 0, 32),  # the 32-block cap
        (32, 1024, 0, 2),  # 2048 threads per SM
        (255, 512, 0, 0),  # does not fit at all
    ],
)
def test_ctas_per_sm(regs, threads, smem, ctas):
    """Resident blocks per SM from registers, threads and shared memory (sm_90 / sm_100 limits)."""
    assert resources.ctas_per_sm(regs, threads, smem) == ctas


def test_ctas_per_sm_rejects_nonsense():
    """Zero threads or registers is an error naming the values."""
    with pytest.raises(ValueError, match="threads=0"):
        resources.ctas_per_sm(32, 0, 0)


def test_missing_cuobjdump_names_the_wheel(monkeypatch):
    """Without cuobjdump the error says which wheel brings it."""
    monkeypatch.setattr(toolchain, "find_toolchain", lambda: None)
    monkeypatch.setattr(resources.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-cuobjdump"):
        resources.find_cuobjdump()


@pytest.mark.slow
def test_sweep_report_names_candidates_at_the_sweep_shape(tools, capsys):
    """`--sweep` compiles the sweep's candidates at its shape (here a small one) and names each `key[i]`
    in a legend: the per-element Sinkhorn backward with its tile."""
    from tools.cutile.sweep import CANDIDATES

    i = next(i for i, c in enumerate(CANDIDATES["sinkhorn"]) if c.per_element)
    assert (
        resources.main(
            [
                "--sweep",
                "--keys",
                "sinkhorn",
                "--match",
                f"sinkhorn[{i}]-sinkhorn_bwd",
                "--tokens",
                "256",
                "--hidden",
                "512",
                "--iterations",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"| sinkhorn[{i}]-sinkhorn_bwd_elem | " in out
    assert f"sinkhorn[{i}]: {CANDIDATES['sinkhorn'][i]!r}" in out and "per_element=True" in out


def test_sweep_report_refuses_unknown_keys(capsys):
    """An unknown sweep key is a usage error naming it, before anything compiles."""
    with pytest.raises(SystemExit) as exc:
        resources.main(["--sweep", "--keys", "sinkhorn,nope"])
    assert exc.value.code == 2 and "['nope'] are not in the sweep" in capsys.readouterr().err
