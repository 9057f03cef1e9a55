"""The tile sweep's candidates are legal tiles: each runs its op through the CPU kernel interpreter."""

from __future__ import annotations

import pytest
import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.ops import make_ops
from mhc_core.kernels.cutile.runtime import EmulatedRuntime
from mhc_core.kernels.cutile.sweep import CANDIDATES, override, timers

CASES = [pytest.param(key, cand, id=f"{key}-{i}") for key, cands in CANDIDATES.items() for i, cand in enumerate(cands)]


@pytest.fixture(scope="module")
def emu():
    return make_ops(EmulatedRuntime(num_sms=4))


@pytest.mark.parametrize(("key", "cand"), CASES)
def test_candidate_runs_and_is_finite(emu, key, cand):
    """Every candidate of every key runs its op's timed direction(s) and gives finite results."""
    with tiling.overridden(**override(key, cand)):
        fns = timers(emu, key, 40, 4, 1024, torch.bfloat16, "megatron_dev", 3, device="cpu")
        assert fns, f"{key}: no direction to time"
        for direction, fn in fns.items():
            result = fn()
            tensors = result if isinstance(result, tuple) else (result,)
            for t in tensors:
                assert torch.isfinite(t.float()).all(), f"{key}={cand} {direction}: non-finite result"


def test_occupancy_override_is_checked():
    """An occupancy hint names known kernels and lies in 1-32; it is readable only inside its block."""
    with tiling.overridden(occupancy={"h_aggregate_fwd_kernel": 4}):
        assert tiling.occupancy("h_aggregate_fwd_kernel") == 4
        assert tiling.occupancy("h_post_bda_fwd_kernel") is None
    assert tiling.occupancy("h_aggregate_fwd_kernel") is None
    with pytest.raises(ValueError, match="occupancy"):
        with tiling.overridden(occupancy={"h_aggregate_fwd_kernel": 64}):
            pass
    with pytest.raises(ValueError, match="occupancy"):
        with tiling.overridden(occupancy={"no_such_kernel": 2}):
            pass


def test_first_candidate_is_the_default():
    """The first candidate of each stream key is what the heuristic picks at n = 4, C = 4096."""
    assert CANDIDATES["sinkhorn"][0] == tiling.sinkhorn_tile(4)
    assert all(key.removesuffix("_occupancy") in tiling.KERNELS_OF for key in CANDIDATES)
    for op, fn in (("h_aggregate", tiling.aggregate_tiles), ("h_post_bda", tiling.post_bda_tiles),
                   ("mapping", lambda n, c, d: tiling.mapping_tiles(n, n * c, d))):
        for direction in ("fwd", "bwd"):
            assert CANDIDATES[f"{op}_{direction}"][0] == fn(4, 4096, direction)


def test_list_prints_every_candidate(capsys):
    """`--list` prints one `key index` line per candidate (what gpu_check's parallel warm-up reads), no GPU needed."""
    from mhc_core.kernels.cutile.sweep import main

    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(len(c) for c in CANDIDATES.values())
    assert lines[0] == "sinkhorn 0" and all(len(line.split()) == 2 for line in lines)
