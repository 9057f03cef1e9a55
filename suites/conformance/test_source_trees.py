"""Peers read from a source tree (TransformerEngine's Triton mHC, torchtitan's DeepSeek-V4), the stand-in
driver their interpreted kernels need, and peers without a backward (the inference engines)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.conformance.matrix import run_matrix
from harness.peers.base import Peer
from harness.peers.te_triton import KERNELS_FILE, TeTritonPeer, load_te_mhc
from harness.peers.torchtitan import MHC_FILE, TorchtitanPeer
from harness.peers.triton_interpreter import device_properties, interpreted, prepare_interpreter

TE_TREE = os.environ.get("MHC_TRANSFORMER_ENGINE")
TITAN_TREE = os.environ.get("MHC_TORCHTITAN")
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not interpreted() or prepare_interpreter() is not None,
    reason="needs triton, no GPU, and TRITON_INTERPRET=1 before triton imports",
)


@pytest.mark.parametrize(
    ("option", "missing"), [("--transformer-engine", str(KERNELS_FILE)), ("--torchtitan", str(MHC_FILE))]
)
def test_a_bad_tree_is_refused_naming_it(tmp_path, capsys, option, missing):
    """A path that is not a directory, or a directory without the peer's files, is refused naming the option,
    the path and the missing file (exit 2), before anything runs or is written."""
    for path, message in ((tmp_path / "nowhere", "not a directory"), (tmp_path, missing)):
        assert 2 == main(["conformance", option, str(path), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert f"{option} {path.resolve()}" in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_tree_from_the_environment_that_is_not_one_is_a_skip_reason(tmp_path):
    """A tree named by the environment (MHC_TRANSFORMER_ENGINE / MHC_TORCHTITAN) is checked by the peer, whose
    row says why it did not run."""
    for peer in (TeTritonPeer(tree=tmp_path), TorchtitanPeer(tree=tmp_path)):
        row = run_matrix([peer]).peer(peer.name)
        assert row.skipped and str(tmp_path) in row.skipped and "no " in row.skipped, row.skipped


PRUNED = """
import triton
import triton.language as tl


def keep_what_fits(configs, named_args, **kwargs):
    smem = triton.runtime.driver.active.utils.get_device_properties(
        triton.runtime.driver.active.get_current_device())["max_shared_mem"]
    return [c for c in configs if c.kwargs["BLOCK"] * 1024 <= smem]


@triton.autotune(configs=[triton.Config({"BLOCK": 256}), triton.Config({"BLOCK": 8})], key=["n"],
                 prune_configs_by={"early_config_prune": keep_what_fits})
@triton.jit
def double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=mask), mask=mask)
"""


@needs_interpreter
def test_a_pruner_that_reads_the_device_runs_with_the_stand_in_driver(tmp_path):
    """A configuration pruner that asks the active driver for shared memory (as TE's projection backward does)
    fails under the interpreter, and runs with an H100's properties stood in; the driver is put back after."""
    import triton.runtime

    from harness.peers.triton_interpreter import without_autotune_timing

    (tmp_path / "mhc_pruned.py").write_text(PRUNED)
    spec = importlib.util.spec_from_file_location("mhc_pruned", tmp_path / "mhc_pruned.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mhc_pruned"] = mod
    spec.loader.exec_module(mod)
    without_autotune_timing(mod)
    x, out = torch.arange(10, dtype=torch.float32), torch.empty(10)

    def run():
        mod.double[lambda meta: ((10 + meta["BLOCK"] - 1) // meta["BLOCK"],)](x, out, 10)

    with pytest.raises(RuntimeError, match="active drivers"):
        run()
    with device_properties():
        run()
    assert torch.equal(out, 2 * x)
    assert mod.double.best_config.kwargs == {"BLOCK": 8}  # 256 KiB does not fit in an H100's 227 KiB
    assert triton.runtime.driver._active is None


@dataclass(frozen=True, kw_only=True)
class _ForwardOnly(Peer):
    """mhc_core's reference mix and Sinkhorn, asserting it runs without autograd (as an inference kernel)."""

    name: str = "forward_only"
    description: str = "reference ops, no backward"
    ops: frozenset[str] = frozenset({"mix", "sinkhorn"})
    differentiable: bool = False

    def mix(self, h_res, residual, h_post, y):
        from mhc_core.ops import h_post_bda

        assert not torch.is_grad_enabled()
        return h_post_bda(h_res, residual, h_post, y, None, variant="megatron_main")

    def sinkhorn(self, logits, iterations):
        from mhc_core.ops import sinkhorn

        assert not torch.is_grad_enabled()
        return sinkhorn(logits, iterations, variant="megatron_main")


def test_a_peer_without_a_backward_is_compared_on_its_outputs():
    """A peer that is not differentiable runs under no_grad and conforms on its outputs alone: no gradient
    is compared, and none is counted as zero."""
    row = run_matrix([_ForwardOnly()]).peer("forward_only")
    assert row.configuration == "megatron_main" and row.conforms, [c.message for c in row.cells()]
    assert all(not c.worst.startswith("grad") for c in row.cells())


# -- live trees (skipped without one; CI replays the committed recordings instead) ----------------------------


@pytest.fixture
def te_tree() -> Path:
    if not TE_TREE:
        pytest.skip(
            "MHC_TRANSFORMER_ENGINE is not set (a TransformerEngine checkout; the committed recording "
            "te_triton.json stands in for it)"
        )
    if prepare_interpreter() is not None and not torch.cuda.is_available():
        pytest.skip(prepare_interpreter())
    return Path(TE_TREE)


def test_te_from_a_tree_matches_its_recording(te_tree):
    """TE's two mHC files from the tree give the configuration and the passes of the committed recording, and
    nothing is left in sys.modules pretending TransformerEngine is installed."""
    live = run_matrix([TeTritonPeer(tree=te_tree)]).peer("te_triton")
    recorded = run_matrix([p for p in _recorded() if p.name == "te_triton[recorded]"]).peer(
        "te_triton[recorded]"
    )
    assert live.configuration == recorded.configuration
    assert [c.status for c in live.cells()] == [c.status for c in recorded.cells()]
    assert "transformer_engine" not in sys.modules


GOOD = "tl.reshape(tl.trans(H_res, (0, 2, 1)), (BLOCK_SIZE_M, n, 2, 2))"
FAULT = "tl.reshape(H_res, (BLOCK_SIZE_M, n, 2, 2))"
"""TE's expand-combine forward splits H_res^T into columns; without the transpose it mixes with H_res."""


def test_a_transposed_index_in_tes_interpreted_kernel_is_caught(te_tree, monkeypatch):
    """TE's `_mhc_expand_combine_fwd` rebuilt from the tree's source without its transpose: the orientation
    check observes H @ x and fails; Sinkhorn (other kernels) still passes."""
    import triton

    wrapper = load_te_mhc(te_tree.resolve())
    tuner = wrapper._mhc_expand_combine_fwd
    source = textwrap.dedent(inspect.getsource(tuner.fn.fn))
    assert source.count(GOOD) == 1, f"TE's expand-combine kernel changed: {GOOD!r} not found once"
    tree = ast.parse(source.replace(GOOD, FAULT))
    kernel_def = tree.body[0]
    assert isinstance(kernel_def, ast.FunctionDef), ast.dump(kernel_def)[:80]
    kernel_def.decorator_list = []
    namespace = dict(tuner.fn.fn.__globals__)
    exec(compile(tree, "<TE expand_combine, untransposed H_res>", "exec"), namespace)
    monkeypatch.setattr(tuner, "fn", triton.jit(namespace["_mhc_expand_combine_fwd"]))
    peer = TeTritonPeer(tree=te_tree, ops=frozenset({"mix", "sinkhorn"}))
    cells = {c.check: c for c in run_matrix([peer]).peer("te_triton").cells("megatron_main+transposed_mix")}
    assert cells["orientation n4 fp32"].status == "fail" and cells["orientation n4 fp32"].observed == "H @ x"
    assert cells["sinkhorn s1 it20 n4 fp32"].status == "pass"


def test_torchtitan_from_a_tree_matches_its_recording():
    """torchtitan's mhc.py from the tree gives the configuration and the passes of the committed recording."""
    if not TITAN_TREE:
        pytest.skip(
            "MHC_TORCHTITAN is not set (a torchtitan checkout of PR #3634; the committed recording "
            "torchtitan.json stands in for it)"
        )
    live = run_matrix([TorchtitanPeer(tree=Path(TITAN_TREE))]).peer("torchtitan")
    recorded = run_matrix([p for p in _recorded() if p.name == "torchtitan[recorded]"]).peer(
        "torchtitan[recorded]"
    )
    assert live.configuration == recorded.configuration
    assert [c.status for c in live.cells()] == [c.status for c in recorded.cells()]


def _recorded():
    from harness.conformance.replay import recorded_peers

    return recorded_peers()


def test_megatron_lite_from_a_tree_matches_its_recording():
    """Megatron Lite's mHC files from a Megatron-LM tree give the configuration and the passes of the committed
    recording (dev d48bd6be)."""
    from harness.peers.megatron_lite import MegatronLitePeer

    tree = os.environ.get("MHC_MEGATRON_LM")
    if not tree:
        pytest.skip(
            "MHC_MEGATRON_LM is not set (a Megatron-LM dev checkout with experimental/lite; the committed "
            "recording megatron_lite.json stands in for it)"
        )
    peer = MegatronLitePeer(tree=Path(tree))
    why = peer.unavailable()
    if why:
        pytest.skip(why)
    live = run_matrix([peer]).peer("megatron_lite")
    recorded = run_matrix([p for p in _recorded() if p.name == "megatron_lite[recorded]"]).peer(
        "megatron_lite[recorded]"
    )
    assert live.configuration == recorded.configuration
    assert [c.status for c in live.cells()] == [c.status for c in recorded.cells()]
