"""The serving engines' mHC (sglang, vLLM: forward only, bf16): what each conforms to, a planted transposed mix
in a copy of their kernel caught by the matrix and by the train/serve bound, and the train/serve measurement at a
CI size (`tox -e trainserve` runs it at depth 61)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from harness.conformance.matrix import run_matrix
from harness.conformance.oracle import oracle
from harness.conformance.trainserve import TRAINER, TrainServeSetup, measure, rel_err
from harness.conformance.trainserve_report import write_trainserve
from harness.peers.base import SublayerParams
from harness.peers.sglang import KERNEL_FILE, SGLANG, SglangPeer, SglangTritonPeer
from harness.peers.vllm import TORCH_FILE, VLLM, VllmPeer, VllmSinglePassPeer

SMALL = TrainServeSetup(depths=(1, 3), tokens=8)
"""The CI size of the train/serve measurement."""
SMALL_SINGLE_PASS = TrainServeSetup(depths=(1, 3), tokens=8, form="single_pass")


def _need(peer):
    why = peer.unavailable()
    if why:
        pytest.skip(f"{peer.name}: {why}")
    return peer


def _not_passing(row):
    return {c.check: c for c in row.cells() if c.status != "pass"}


def test_sglang_torch_path_is_devs_with_eps_inside_the_square_root(matrix):
    """sglang's hc_pre / hc_post conform to megatron_dev with the norm's eps inside the square root (its fp32
    row shows the eps), mixing H^T @ x, in bf16 and fp32."""
    row = matrix.peer("sglang")
    if row.skipped:
        pytest.skip(row.skipped)
    assert row.configuration == "megatron_dev+eps_inside_sqrt" and row.conforms and row.meets_claim, (
        _not_passing(row)
    )
    cells = {c.check: c for c in row.cells()}
    assert cells["orientation n4 bf16"].observed == "H^T @ x"
    plain = {c.check: c for c in row.by_variant["megatron_dev"] if c.status == "fail"}
    assert set(plain) == {"coefficients@rms1e-2 n2 fp32", "coefficients@rms1e-2 n4 fp32"}, plain


@pytest.mark.parametrize("name", ["sglang[triton]", "vllm", "vllm[triton]"])
def test_serving_peer_meets_its_claim(matrix, name):
    """sglang's Triton kernels, vLLM's eager and Triton kernels conform to what they claim of DeepSeek-V4's
    configuration, in bf16, every check they can run passing."""
    row = matrix.peer(name)
    if row.skipped:
        pytest.skip(row.skipped)
    assert row.conforms and row.meets_claim, (row.configuration, _not_passing(row))


def test_sglang_triton_coefficients_match_the_oracle_where_its_kernel_runs():
    """sglang's split-K projection + Sinkhorn kernel and its combine (n*C = 64, the smallest shape it takes) give
    the oracle's H_post, H_res and layer input within bf16 rounding."""
    peer = _need(SglangTritonPeer())
    g = torch.Generator().manual_seed(3)
    n, c, t = 4, 16, 5
    x = torch.randn(t, n, c, generator=g).to(torch.bfloat16)
    big = n * n + 2 * n
    p = SublayerParams(
        n=n,
        weight=torch.randn(big, n * c, generator=g) * 0.2,
        alpha_pre=torch.tensor([0.7]),
        alpha_post=torch.tensor([0.9]),
        alpha_res=torch.tensor([1.3]),
        bias=torch.randn(big, generator=g) * 0.5,
    )
    y, h_res, h_post = peer.pre(x, p, 20)
    p64 = SublayerParams(
        n=n, **{f.name: getattr(p, f.name).double() for f in dataclasses.fields(p) if f.name != "n"}
    )
    ref = oracle(TRAINER).coefficients(x.double(), p64, 20)
    assert rel_err(h_res, ref["h_res"]) < 1e-5 and rel_err(h_post, ref["h_post"]) < 1e-5
    assert rel_err(y, ref["aggregate"]) < 8e-3  # the layer input is rounded to bf16


def _planted(tmp_path: Path, source: Path, pattern: str, replacement: str) -> Path:
    text = source.read_text(encoding="utf-8")
    planted, count = re.subn(pattern, replacement, text)
    assert count == 1, f"the pattern {pattern!r} occurs {count} times in {source}"
    out = tmp_path / source.name
    out.write_text(planted, encoding="utf-8")
    return out


_PLANTS = {
    # sglang's `_mhc_post_torch`: out[o] = sum_i comb[i, o] x[i]; planted: comb transposed (H @ x).
    "sglang": (
        SglangPeer,
        SGLANG,
        KERNEL_FILE,
        r"comb_res_mix\.unsqueeze\(-1\) \* residual\.unsqueeze\(2\)",
        "comb_res_mix.transpose(-1, -2).unsqueeze(-1) * residual.unsqueeze(2)",
    ),
    # vLLM's `mhc_post_torch`: einsum "...ij,...ih->...jh"; planted: "...ji,...ih->...jh".
    "vllm": (VllmPeer, VLLM, TORCH_FILE, r'"\.\.\.ij,\.\.\.ih->\.\.\.jh"', '"...ji,...ih->...jh"'),
}


@pytest.mark.parametrize("engine", sorted(_PLANTS))
def test_a_planted_transposed_mix_in_a_copy_of_the_serving_kernel_is_caught(tmp_path, engine):
    """A copy of the engine's kernel file with the mix transposed: the matrix sees the orientation and the claim
    unmet, and the train/serve bound fails naming the mix as the first op that differs."""
    cls, files, file, pattern, replacement = _PLANTS[engine]
    _need(cls())
    copy = _planted(tmp_path, files.path(file), pattern, replacement)
    mutant = cls(name=f"{engine}[planted]", source=copy)
    row = run_matrix([mutant]).peer(mutant.name)
    assert not row.meets_claim and "untransposed_mix" in (row.configuration or ""), row.configuration
    orientation = next(c for c in row.cells(mutant.claims) if c.check.startswith("orientation"))
    assert orientation.status == "fail" and orientation.observed == "H @ x"
    (trainer, planted) = (lambda rows: (rows[0], rows[1]))(measure([mutant], SMALL))
    assert planted.passed is False and trainer.passed
    assert "first op that differs: the mix" in planted.reason and "untransposed_mix" in planted.reason, (
        planted.reason
    )


def test_train_serve_measurement_at_ci_size(tmp_path):
    """sglang (torch path and Triton kernels) and vLLM track the trainer within the bound at a small depth, are
    deterministic and batch invariant here, and the report is written (table, JSON, plot)."""
    peers = [_need(p) for p in (SglangPeer(), SglangTritonPeer(), VllmPeer())]
    rows = measure(peers, SMALL)
    assert [r.name for r in rows[1:]] == [p.name for p in peers]
    for r in rows:
        assert r.passed, r.reason
        assert r.deterministic and r.batch_invariant, (r.name, r.batch_max_abs)
        assert 0 < r.vs_fp64[0] < 5e-2, (r.name, r.vs_fp64)
    js, md, png = write_trainserve(rows, SMALL, tmp_path)
    text = md.read_text()
    assert "agrees with the trainer to" in text and "| sglang 0.5.23 |" in text
    assert png.stat().st_size > 1000 and js.is_file()


def test_single_pass_train_serve_at_ci_size(tmp_path):
    """vLLM's DeepSeek-V4.1 path (`mhc_pre_delayed_torch` carrying `pre_mix`, `mhc_post_torch`) tracks the single-pass
    trainer within the bound, deterministic and batch invariant, and its report is written beside the V4 one."""
    peer = _need(VllmSinglePassPeer())
    rows = measure([peer], SMALL_SINGLE_PASS)
    assert [r.name for r in rows] == ["trainer (mhc_core[deepseek_v41], bf16)", "vllm[v4.1]"]
    for r in rows:
        assert r.passed, r.reason
        assert r.deterministic and r.batch_invariant, (r.name, r.batch_max_abs)
        assert 0 < r.vs_fp64[0] < 5e-2, (r.name, r.vs_fp64)
    js, md, png = write_trainserve(rows, SMALL_SINGLE_PASS, tmp_path)
    assert js.name == "trainserve-single-pass.json" and png.stat().st_size > 1000
    assert "(single-pass, DeepSeek-V4.1)" in md.read_text()


def test_a_planted_per_sublayer_aggregate_in_vllms_single_pass_is_caught(tmp_path):
    """A copy of vLLM's kernel file whose V4.1 pre weights the layer input with its own `pre` instead of the previous
    sublayer's `pre_mix` (V4's reading in a V4.1 model): the single-pass checks fail, and the train/serve bound fails
    naming the layer input."""
    _need(VllmSinglePassPeer())
    copy = _planted(
        tmp_path, VLLM.path(TORCH_FILE), r"else \(pre_mix\.unsqueeze\(-1\)", "else (pre.unsqueeze(-1)"
    )
    mutant = VllmSinglePassPeer(name="vllm[v4.1,planted]", source=copy)
    row = run_matrix([mutant]).peer(mutant.name)
    failing = _not_passing(row)
    assert not row.meets_claim and any(k.startswith("single-pass n4") for k in failing), sorted(failing)
    assert not any(k.startswith("single-pass@entry") for k in failing), sorted(failing)
    trainer, planted = measure([mutant], SMALL_SINGLE_PASS)
    assert trainer.passed and planted.passed is False
    assert "first op that differs: the layer input" in planted.reason, planted.reason


def test_train_serve_setup_names_a_bad_shape():
    """A width the engines' kernels cannot take, or depths out of order, are named."""
    with pytest.raises(ValueError, match="multiple of 64"):
        TrainServeSetup(hidden=8)
    with pytest.raises(ValueError, match="depths"):
        TrainServeSetup(depths=(8, 1))
