"""The signature registry is the dispatch's own list of launches: complete, distinct, readable."""

from __future__ import annotations

import re

import pytest
import torch

from mhc_core.kernels.cutile import CuTileBackend, tiling
from mhc_core.kernels.cutile.runtime import KERNEL_MODULES
from mhc_core.kernels.dispatch import bound_ops
from mhc_core.variants import Variant
from tools.cutile.recording import ArrayArg, ConstArg, RecordingRuntime
from tools.cutile.signatures import alternative_plan, signature_plan

ID_RE = re.compile(
    r"^(sinkhorn|h_aggregate|h_post_bda|mapping|pre)-(fwd|bwd)-n\d+-(bf16|fp32)-(main|dev|paper)[-a-z0-9_]*$"
)


ALTERNATIVE_ONLY = {"sinkhorn_fwd_elem_kernel", "sinkhorn_bwd_elem_kernel"}
"""Kernels the default tiles never launch (`SinkhornTiles.per_element`: a shipped tuning's)."""


def test_plan_covers_every_kernel_and_n():
    """Every kernel of the default tiles appears for every supported n; the others in the alternative plan."""
    plan = signature_plan()
    for n in tiling.SUPPORTED_N:
        kernels = {p.kernel_name for p in plan if f"-n{n}-" in p.id}
        want = set(KERNEL_MODULES) - ALTERNATIVE_ONLY
        assert kernels == want, f"n={n}: missing {want - kernels}, unexpected {kernels - want}"
    alternative = {p.kernel_name for p in alternative_plan()}
    assert ALTERNATIVE_ONLY <= alternative, f"alternative plan lacks {ALTERNATIVE_ONLY - alternative}"


class _Tensors(RecordingRuntime):
    """Records like `RecordingRuntime` and keeps each launch's tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[list[torch.Tensor]] = []

    def launch(self, grid, kernel_name, args):
        self.tensors.append([a for a in args if isinstance(a, torch.Tensor)])
        super().launch(grid, kernel_name, args)


@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
def test_sinkhorn_workspace_only_for_the_stored_backward(variant):
    """The `[TILE_B, n, n]` backward gets a `[max(P, 1), B, n, n]` fp32 workspace, a row per pair
    (megatron_dev: one pair fewer); the per-element backward, which recomputes, gets none."""
    rec = _Tensors()
    ops = bound_ops(CuTileBackend(rec))
    z = torch.zeros(40, 4, 4, requires_grad=True)
    ops.sinkhorn(z, 20, None, variant).sum().backward()
    with tiling.overridden(sinkhorn=tiling.SinkhornTiles(32, per_element=True)):
        ops.sinkhorn(z, 20, None, variant).sum().backward()
    names = [la.kernel_name for la in rec.launches]
    assert names == [
        "sinkhorn_fwd_kernel",
        "sinkhorn_bwd_kernel",
        "sinkhorn_fwd_elem_kernel",
        "sinkhorn_bwd_elem_kernel",
    ]
    pairs = 19 if variant is Variant.MEGATRON_DEV else 20
    assert tuple(rec.tensors[1][3].shape) == (pairs, 40, 4, 4) and rec.tensors[1][3].dtype == torch.float32
    assert len(rec.tensors[3]) == 3  # logits, grad_out, grad_logits


def test_plan_ids_are_unique_and_readable():
    """Ids are unique and read `op-direction-nN-dtype-variant[-detail]`."""
    ids = [p.id for p in signature_plan()]
    assert len(ids) == len(set(ids))
    bad = [i for i in ids if not ID_RE.match(i)]
    assert not bad, f"unreadable ids: {bad[:5]}"


@pytest.mark.parametrize(("t", "c"), [(32, 1024), (4096, 4096)], ids=["T32-C1024", "T4096-C4096"])
def test_plan_covers_other_production_shapes(t, c):
    """Launches at other production-like sizes (C >= 512) are all in the plan.

    Compared by layout (dtype, rank, unit strides, constants, scalar kinds): the alignment and
    divisibility hints of the JIT depend on the sizes (e.g. the K-split count), not the code path.
    """

    def key(kernel_name, args):
        return kernel_name, tuple(a.layout if isinstance(a, ArrayArg) else a for a in args)

    planned = {key(p.kernel_name, p.args) for p in signature_plan()}
    rec = RecordingRuntime()
    ops = bound_ops(CuTileBackend(rec))
    n = 4
    small_t = min(t, 64)  # the token count only sets divisibility flags; keep the CPU tensors small
    for dtype in (torch.bfloat16, torch.float32):
        for variant in Variant:
            x = torch.zeros(small_t, n * c, dtype=dtype, requires_grad=True)
            w = torch.zeros(24, n * c, requires_grad=True)
            a = [torch.zeros(1, requires_grad=True) for _ in range(3)]
            b = torch.zeros(24, requires_grad=True)
            with tiling.overridden(pre=tiling.PreTiles(fused=True)):
                fused = ops.pre(x, w, *a, b, n, 3, variant)
                torch.autograd.backward(fused, [torch.zeros_like(o) for o in fused])
            outs = ops.mapping(x, w, *a, b, n, variant)
            torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])
            z = torch.zeros(small_t, n, n, dtype=outs[2].dtype, requires_grad=True)
            ops.sinkhorn(z, 4, None, variant).sum().backward()
            xs = torch.zeros(small_t, n, c, dtype=dtype, requires_grad=True)
            ops.h_aggregate(xs, outs[0].detach().requires_grad_(True)).sum().backward()
            y = torch.zeros(small_t, c, dtype=dtype, requires_grad=True)
            out = ops.h_post_bda(
                z.detach().requires_grad_(True),
                xs,
                outs[1].detach().requires_grad_(True),
                y,
                torch.zeros(c, dtype=dtype, requires_grad=True),
                0.0,
                False,
                variant,
            )
            out.sum().backward()
    recorded = {la.kernel_name for la in rec.launches}
    assert recorded == {p.kernel_name for p in signature_plan()}, sorted(
        recorded
    )  # every kernel was launched
    missing = [
        key(la.kernel_name, la.args) for la in rec.launches if key(la.kernel_name, la.args) not in planned
    ]
    assert not missing, f"{len(missing)} launches not in the signature plan, first: {missing[0]}"


def test_constants_are_recorded_as_constants():
    """`ct.Constant` parameters become compile-time constants of the signature, runtime ints scalars."""
    from tools.cutile.recording import ScalarArg

    launch = next(p for p in signature_plan() if p.id == "mapping-fwd-n4-bf16-main-partial")
    # (x, w_pp, w_res, part_pp, part_res, part_sq, k_tiles_per_split, N, TILE_M, TILE_K, MMA)
    assert all(isinstance(a, ArrayArg) for a in launch.args[:6])
    assert isinstance(launch.args[6], ScalarArg)
    assert [type(a) for a in launch.args[7:]] == [ConstArg] * 4 and launch.args[7].value == 4
