"""A fault planted in an interpreted Triton kernel is caught: Liger-Kernel's residual-mix kernel with
its H_res index transposed (the bug upstream users met as #4957 / #4839), swapped into the installed
package at run time (its source read from the package and one expression changed; nothing is copied)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap

import pytest
import torch

from harness.conformance.matrix import run_matrix
from harness.peers.liger import LigerPeer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None,
    reason="liger-kernel / triton are not installed (the peers extra has them)",
)

GOOD = "o2 * stride_hri + i * stride_hrj"
FAULT = "o2 * stride_hrj + i * stride_hri"
"""The h_res load of `_mhc_post_res_fwd_kernel`: row o, column i -> row i, column o."""


def _transposed_kernel(mhc):
    """Liger's `_mhc_post_res_fwd_kernel` rebuilt from its installed source with `FAULT` for `GOOD`."""
    import triton

    kernel = mhc._mhc_post_res_fwd_kernel
    source = textwrap.dedent(inspect.getsource(getattr(kernel, "fn", kernel)))
    assert source.count(GOOD) == 1, f"liger-kernel's post_res kernel changed: {GOOD!r} not found once"
    tree = ast.parse(source.replace(GOOD, FAULT))
    kernel_def = tree.body[0]
    assert isinstance(kernel_def, ast.FunctionDef), ast.dump(kernel_def)[:80]
    kernel_def.decorator_list = []
    namespace = dict(vars(mhc))
    exec(compile(tree, "<liger post_res, transposed h_res index>", "exec"), namespace)
    return triton.jit(namespace["_mhc_post_res_fwd_kernel"])


def test_transposed_index_in_an_interpreted_kernel_is_caught(monkeypatch):
    """With the transposed kernel the orientation check observes H^T @ x and fails; mix fails with numbers;
    the aggregate (another kernel) still passes."""
    peer = LigerPeer(ops=frozenset({"mix", "aggregate"}))  # the kernels the fault is in, and one it is not in
    if peer.unavailable():
        pytest.skip(peer.unavailable())
    before = {c.check: c for c in run_matrix([peer]).peer(peer.name).by_variant["megatron_main"]}
    assert before["orientation n4 fp32"].status == "pass"

    from liger_kernel.ops import mhc

    monkeypatch.setattr(mhc, "_mhc_post_res_fwd_kernel", _transposed_kernel(mhc))
    after = {c.check: c for c in run_matrix([peer]).peer(peer.name).by_variant["megatron_main"]}
    orientation = after["orientation n4 fp32"]
    assert orientation.status == "fail" and orientation.observed == "H^T @ x", orientation.message
    assert after["mix n4 fp32"].status == "fail" and "max abs err" in after["mix n4 fp32"].message
    assert after["aggregate n4 fp32"].status == "pass"
    if not torch.cuda.is_available():
        assert "interpreted" in (peer.version() or "")
