"""What each peer matches, and how closely: the matrix of the default peers, asserted per peer."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from harness.conformance.matrix import Matrix, run_matrix
from harness.conformance.replay import RECORDED_DIR, load_recording
from harness.peers.base import Peer


def _row(matrix, name):
    row = matrix.peer(name)
    if row.skipped:
        pytest.skip(f"{name}: {row.skipped}")
    return row


def _not_passing(row):
    return {c.check: c for c in row.cells() if c.status != "pass"}


@pytest.mark.parametrize("variant", ["paper", "megatron_main", "megatron_dev"])
def test_mhc_core_matches_its_own_variant_and_no_other(matrix, variant):
    """Each mhc_core variant passes every check against itself and is told apart from the other two."""
    row = matrix.peer(f"mhc_core[{variant}]")
    assert row.best == variant and row.conforms, _not_passing(row)
    for other in set(row.by_variant) - {variant}:
        passes, total = row.score(other)[0], len(row.by_variant[other])
        assert passes < total / 2, (
            f"{variant} passes {passes}/{total} checks of {other}: the checks cannot tell them apart"
        )


def test_hf_deepseek_v4_is_megatron_dev_with_eps_inside_and_the_learned_exit(matrix):
    """transformers' DeepSeek-V4 conforms fully to megatron_dev + eps inside the square root + the learned
    exit; against plain megatron_dev only the small-RMS coefficients fail, naming its eps."""
    row = _row(matrix, "hf_deepseek_v4")
    assert row.best == "megatron_dev"
    assert row.configuration == "megatron_dev+eps_inside_sqrt+learned_exit" and row.conforms, _not_passing(
        row
    )
    plain = {c.check: c for c in row.by_variant["megatron_dev"] if c.status != "pass"}
    assert set(plain) == {"coefficients@rms1e-2 n2 fp32", "coefficients@rms1e-2 n4 fp32"}, plain
    assert all("eps inside the square root" in c.message for c in plain.values())
    orientation = next(c for c in row.cells() if c.check.startswith("orientation"))
    assert orientation.observed == "H^T @ x"
    exit_mean = next(c for c in row.cells("megatron_dev+eps_inside_sqrt") if c.check.startswith("block-exit"))
    assert exit_mean.status == "fail"  # the exit check tells the learned contraction from the mean


@pytest.mark.parametrize(
    ("name", "stack"),
    [
        ("mhc_core[deepseek_v41]", "chained"),
        ("nemo_automodel[v4.1]", "own"),
        ("vllm[v4.1]", None),
        ("vllm[v4.1,triton]", None),
    ],
)
def test_single_pass_implementations_are_deepseek_v41(matrix, name, stack):
    """Ours in V4.1's numerics, NeMo Automodel's DeepSeek-V4.1 and vLLM's V4.1 serving path conform to V4.1's numerics
    as the checks tell them (dev's, eps inside the square root): every single-pass check passes, the handoff, the
    entry's stream 0 and the eps at small RMS; the single-pass stack (NeMo's own blocks and exit, ours chained by
    the suite; vLLM has no mix or exit op to chain) with every parameter part receiving its gradient. vLLM's Triton
    seam kernels (interpreted) show the layer input and the next H_pre only."""
    row = _row(matrix, name)
    assert row.configuration == "megatron_dev+eps_inside_sqrt" and row.meets_claim, _not_passing(row)
    by = {c.check: c for c in row.cells()}
    for check in ("single-pass", "single-pass@entry", "single-pass@rms1e-2"):
        assert all(c.status == "pass" for k, c in by.items() if k.startswith(check + " ")), check
    stacks = [c for k, c in by.items() if k.startswith("single-pass-stack")]
    if stack is None:
        assert not stacks
    else:
        assert stacks and all(c.status == "pass" for c in stacks), stacks
        assert ("chained by the suite" in stacks[0].message) == (stack == "chained"), stacks[0].message
    plain = {c.check: c for c in row.cells("megatron_dev")}
    assert plain["single-pass@rms1e-2 n4 fp32"].status == "fail"  # the eps after the root misses


def test_nemo_automodel_is_deepseek_v4_as_hugging_faces(matrix):
    """NeMo Automodel's DeepSeek-V4 conforms to megatron_dev + eps inside the square root + the learned exit, as
    transformers' does, with the mix transposed as DeepSeek's (`comb^T @ streams`) and its block chained as the
    stack."""
    row = _row(matrix, "nemo_automodel")
    assert row.configuration == "megatron_dev+eps_inside_sqrt+learned_exit" and row.conforms, _not_passing(
        row
    )
    orientation = next(c for c in row.cells() if c.check.startswith("orientation"))
    assert orientation.observed == "H^T @ x"
    stack = [c for c in row.cells() if c.check.startswith("stack")]
    assert stack and all(c.status == "pass" for c in stack), stack


def test_mhc_package_has_mains_sinkhorn_but_for_its_eps_and_no_streams(matrix):
    """The `mhc` package: its Sinkhorn-Knopp is megatron_main's (every fp32 check passes, the columns exact) but
    for the 1e-9 added to every sum, which fp64 shows (named beside each failing check); every other op is not
    comparable, saying it has no n-stream residual."""
    row = _row(matrix, "mhc")
    assert row.best == "megatron_main" and not row.conforms
    cells = {c.check: c for c in row.cells("megatron_main")}
    sinkhorn = {k: c for k, c in cells.items() if k.startswith(("sinkhorn", "exact-sums"))}
    fp32 = {k: c for k, c in sinkhorn.items() if k.endswith("fp32")}
    fp64 = {k: c for k, c in sinkhorn.items() if k.endswith("fp64")}
    assert fp32 and all(c.status == "pass" for c in fp32.values()), {k: c.message for k, c in fp32.items()}
    assert cells["exact-sums n4 fp32"].observed == "cols"
    failing = {k: c for k, c in fp64.items() if c.status == "fail"}
    assert failing and all("sum + 1e-9" in c.message for k, c in failing.items() if k.startswith("sinkhorn"))
    for op in ("coefficients", "aggregate", "mix", "layer", "block_exit", "stack"):
        assert cells[op].status == "n/a" and "no n-stream residual" in cells[op].message, cells[op]


def test_lucidrains_has_papers_sinkhorn_a_transposed_mix_and_says_what_differs(matrix):
    """lucidrains' Sinkhorn is the paper's (columns then rows, rows exact); its mix is H^T @ x; its
    coefficients are reported not comparable, naming its norm and its projection."""
    row = _row(matrix, "lucidrains")
    assert row.best == "paper" and row.configuration == "paper+transposed_mix" and row.conforms
    cells = {c.check: c for c in row.cells("paper")}
    assert all(
        c.status == "pass" for k, c in cells.items() if k.startswith(("sinkhorn", "exact-sums", "aggregate"))
    )
    assert cells["exact-sums n4 fp32"].observed == "rows"
    assert (
        cells["orientation n4 fp32"].observed == "H^T @ x" and cells["orientation n4 fp32"].status == "fail"
    )
    na = cells["coefficients"]
    assert (
        na.status == "n/a"
        and "RMSNorm over C with a learned gain" in na.message
        and "projection" in na.message
    )
    assert cells["layer"].status == "n/a" and cells["block_exit"].status == "n/a"


def test_liger_has_devs_coefficients_and_mains_mix(matrix):
    """Liger-Kernel (interpreted without a GPU): its coefficients are megatron_dev's (softmax-started
    Sinkhorn with eps) but for its eps inside the square root, and it mixes H @ x as megatron_main does,
    so its layer matches no variant, and it conforms fully to megatron_dev+eps_inside_sqrt+untransposed_mix."""
    row = _row(matrix, "liger_kernel")
    assert row.configuration == "megatron_dev+eps_inside_sqrt+untransposed_mix" and row.conforms, (
        _not_passing(row)
    )
    by = {v: {c.check: c for c in cells} for v, cells in row.by_variant.items()}
    for n in (2, 4):
        assert by["megatron_dev"][f"coefficients n{n} fp32"].status == "pass"
        assert by["megatron_main"][f"coefficients n{n} fp32"].status == "fail"
        assert all(by[v][f"aggregate n{n} fp32"].status == "pass" for v in by)
        assert all(by[v][f"layer n{n} fp32"].status == "fail" for v in by)
        small = by["megatron_dev"][f"coefficients@rms1e-2 n{n} fp32"]
        assert small.status == "fail" and "eps inside the square root" in small.message
    assert by["megatron_main"]["orientation n4 fp32"].status == "pass"
    assert by["megatron_dev"]["orientation n4 fp32"].observed == "H @ x"
    assert by["megatron_main"]["sinkhorn"].status == "n/a"
    if not torch.cuda.is_available():
        assert "interpreted" in (row.version or "")


@pytest.mark.parametrize(
    ("peer", "variant", "configuration", "checks"),
    [
        ("megatron_lm[main]", "megatron_main", "megatron_main", 48),
        ("megatron_lm[dev]", "megatron_dev", "megatron_dev+learned_exit", 24),
        ("megatron_lm[dev,fused]", "megatron_dev", "megatron_dev+learned_exit", 24),
        ("megatron_lm[dev,fused,triton]", "megatron_dev", "megatron_dev+learned_exit", 24),
        ("megatron_lm[single_pass]", "megatron_dev", "megatron_dev+eps_inside_sqrt", 27),
        ("megatron_lm[single_pass,fused]", "megatron_dev", "megatron_dev+eps_inside_sqrt", 27),
    ],
)
def test_upstream_recordings_conform(matrix, peer, variant, configuration, checks):
    """The committed numbers of upstream main and dev (native and fused modules, the fused one on its torch
    and, interpreted, its Triton backend) pass every check of the variant named after them; dev's with its
    learned block exit, the configuration it claims; upstream's single-pass module (9633c754's file over dev's
    module) DeepSeek-V4.1's numerics, its single-pass, aggregate (exit) and mix checks all passing."""
    row = matrix.peer(peer)
    assert row.best == variant and row.configuration == configuration and row.meets_claim, _not_passing(row)
    assert len(row.by_variant[variant]) == checks


def test_recordings_carry_their_provenance():
    """Each committed recording names its repository, branch, commit (a released package: its name and version)
    and the sha256 of the files that ran."""
    files = {
        "NVIDIA/Megatron-LM": (
            "megatron/core/transformer/hyper_connection.py",
            "experimental/lite/megatron/lite/primitive/modules/attention/hca.py",  # Megatron Lite
        ),
        "NVIDIA/TransformerEngine": ("transformer_engine/common/triton/mhc.py",),
        "pytorch/torchtitan": ("torchtitan/models/deepseek_v4/mhc.py",),
        "AI-Hypercomputer/maxtext": ("maxtext/layers/mhc.py",),
    }
    seen = set()
    for path in sorted(RECORDED_DIR.glob("*.json")):
        src = json.loads(path.read_text())["source"]
        assert src["repository"] in files, path
        assert len(src["commit"] or "") == 40 or src.get("package", "").startswith("maxtext "), path
        assert set(files[src["repository"]]) & set(src["files_sha256"]), path
        seen.add((src["repository"], src["branch"]))
    assert {
        ("NVIDIA/Megatron-LM", "main"),
        ("NVIDIA/Megatron-LM", "dev"),
        ("NVIDIA/TransformerEngine", "main"),
        ("pytorch/torchtitan", "pull/3634"),
    } <= seen


def test_the_single_pass_recording_names_the_file_and_the_tree_it_ran_on():
    """Upstream's single-pass file is newer than any tree: its recording names the file's own commit and sha256
    beside the dev tree whose HyperConnectionModule it subclassed."""
    src = json.loads((RECORDED_DIR / "megatron_lm_single_pass.json").read_text())["source"]
    file = "megatron/core/transformer/single_pass_mhc.py"
    assert src["file_commits"][file].startswith("9633c754") and len(src["files_sha256"][file]) == 64
    assert (
        src["commit"].startswith("d48bd6be")
        and "megatron/core/transformer/hyper_connection.py" in src["files_sha256"]
    )


def test_megatron_lite_mixes_untransposed_against_its_deepseek_v4_claim(matrix):
    """Megatron Lite's DeepSeek-V4 hyper connection (recorded from dev d48bd6be) loads DeepSeek-V4's weights but
    computes megatron_main's mHC: `comb @ residual` where DeepSeek-V4 mixes `comb^T @ residual`, main's Sinkhorn,
    eps outside the square root. Its claim is not met, and the why names the orientation first; its head puts
    the eps inside the square root (the fp64 misses against `megatron_main+learned_exit`). In bf16 its Sinkhorn
    iterates in bf16 (`input_dtype_sinkhorn`): no column sum is left exact (4.5e-3 off, beyond what one rounding of
    an fp32 result leaves), which names the option; its bf16 stack is within 1.2x of the half-precision bound."""
    row = matrix.peer("megatron_lite[recorded]")
    assert row.claims == "megatron_dev+eps_inside_sqrt+learned_exit" and not row.meets_claim
    assert row.configuration == "megatron_main+learned_exit+input_dtype_sinkhorn", row.configuration
    misses = row.claim_misses()
    assert misses[0].check.startswith("orientation ") and misses[0].observed == "H @ x", misses[0]
    failing = {k: c for k, c in _not_passing(row).items() if c.status == "fail"}
    assert set(failing) == {"block-exit n2 fp64", "block-exit n4 fp64", "stack n4 fp64", "stack n4 bf16"}, (
        failing
    )
    assert failing["stack n4 bf16"].ratio is not None and failing["stack n4 bf16"].ratio < 1.2
    plain = {c.check: c for c in row.cells("megatron_main+learned_exit")}
    assert plain["exact-sums n4 bf16"].status == "fail"
    src = json.loads((RECORDED_DIR / "megatron_lite.json").read_text())["source"]
    assert src["commit"].startswith("d48bd6be") and src["branch"] == "dev"


def test_a_tree_without_megatron_lite_says_so(tmp_path):
    """A Megatron-LM tree without `experimental/lite` (main, an older dev): the live row names the missing file."""
    from harness.peers.megatron_lite import MegatronLitePeer

    why = MegatronLitePeer(tree=tmp_path).unavailable()
    assert why and "--megatron-lm" in why and "experimental/lite/megatron/lite" in why, why


def test_te_triton_is_main_with_a_transposed_mix_and_the_dtype_eps(matrix):
    """TransformerEngine's Triton mHC (recorded through the interpreter from d0067d0d): megatron_main's
    coefficients and log-domain Sinkhorn (columns exact), mixed H^T @ x, its norm's eps float32's machine eps
    inside the square root: it conforms to `megatron_main+dtype_eps_inside_sqrt+transposed_mix`, and with the
    model's 1e-6 on either side of the square root it fails where the RMS is small. Its layers chained by the
    suite pass the stack checks."""
    row = matrix.peer("te_triton[recorded]")
    assert row.configuration == "megatron_main+dtype_eps_inside_sqrt+transposed_mix", row.configuration
    assert row.conforms
    assert set(_not_passing(row)) == {"block_exit"}, _not_passing(row)
    cells = {c.check: c for c in row.cells()}
    assert cells["stack n4 fp32"].status == "pass" and cells["stack-grads n4 fp32"].status == "pass"
    for other in ("megatron_main+transposed_mix", "megatron_main+eps_inside_sqrt+transposed_mix"):
        cells = {c.check: c for c in row.cells(other)}
        assert (
            cells["coefficients@rms1e-2 n4 fp32"].status == "fail"
            and cells["coefficients n4 fp32"].status == "pass"
        )
        assert "grad x" in cells["coefficients@rms1e-2 n4 fp32"].message
    cells = {c.check: c for c in row.cells()}
    assert (
        cells["exact-sums n4 fp32"].observed == "cols" and cells["orientation n4 fp32"].observed == "H^T @ x"
    )
    assert "interpreted" in row.version


def test_torchtitan_sinkhorn_is_not_deepseek_v4s(matrix):
    """torchtitan's DeepSeek-V4 mHC (recorded from PR #3634 at 99222f64): the mix, the norm (eps inside), the
    learned exit and H_pre match; its Sinkhorn (exp(Z - rowmax), then rows and columns divided by sum + eps)
    is neither main's (clamp: columns exact) nor dev's / DeepSeek-V4's (softmax + eps start): it fails at
    logit scale 10, and against the configuration HF DeepSeek-V4 conforms to its n = 4 coefficients fail. Its
    chained stack of 4-iteration Sinkhorns misses the output bound (3.4x when recorded); every parameter part
    still gets its gradient (stack-grads)."""
    row = matrix.peer("torchtitan[recorded]")
    assert row.configuration == "megatron_main+eps_inside_sqrt+learned_exit+transposed_mix", row.configuration
    failing = _not_passing(row)
    assert set(failing) - {"aggregate"} == {
        "sinkhorn s10 it1 n2 fp32",
        "sinkhorn s10 it1 n4 fp32",
        "sinkhorn s10 it20 n4 fp32",
        "exact-sums n4 fp32",
        "stack n4 fp32",
    }, failing
    assert "out: max abs err" in failing["stack n4 fp32"].message
    assert next(c for c in row.cells() if c.check == "stack-grads n4 fp32").status == "pass"
    assert all(
        c.status == "pass" for c in row.cells() if c.op in ("coefficients", "mix", "layer", "block_exit")
    )
    deepseek = {c.check: c for c in row.cells("megatron_dev+eps_inside_sqrt+learned_exit")}
    assert (
        deepseek["coefficients n4 fp32"].status == "fail"
        and "h_res" in deepseek["coefficients n4 fp32"].message
    )
    assert deepseek["layer n4 fp32"].status == "fail"


def test_a_recording_on_other_inputs_is_an_error_naming_it():
    """If the cases change after a recording, its checks are errors naming the file and how to re-record."""
    (peer, *_) = load_recording(RECORDED_DIR / "megatron_lm_main.json")
    checks = {k: {**v, "inputs_sha256": "0" * 64} for k, v in peer.checks.items()}
    row = run_matrix([replace(peer, checks=checks)]).peer(peer.name)
    cell = next(c for c in row.cells() if c.status != "n/a")
    assert cell.status == "error" and "was recorded on other inputs" in cell.message
    assert "megatron_lm_main.json" in cell.message and "record_megatron_lm" in cell.message


def test_gpu_peers_say_why_they_did_not_run(matrix):
    """TileKernels, vLLM, sglang and flashinfer need a GPU; TE and torchtitan need a tree (or a GPU for the installed
    TE): where they cannot run, their row says why."""
    for name, reason in (
        ("tile_kernels", "CUDA GPU"),
        ("flashinfer", "CUDA GPU"),
        ("vllm[tilelang]", "CUDA GPU"),
        ("sglang[tilelang]", "CUDA GPU"),
        ("te_triton", "--transformer-engine"),
        ("torchtitan", "--torchtitan"),
    ):
        row = matrix.peer(name)
        if row.skipped is None:
            assert row.best is not None
            continue
        assert reason in row.skipped or "not installed" in row.skipped, row.skipped


class _Raising(Peer):
    def mix(self, h_res, residual, h_post, y):
        raise RuntimeError("kernel exploded")

    def sinkhorn(self, logits, iterations):
        from mhc_core.ops import sinkhorn

        return sinkhorn(logits, iterations, variant="paper")


def test_a_peer_that_raises_is_named_and_the_rest_still_runs():
    """An op that raises gives error cells naming the peer, the op, the exception and the shapes; its
    other checks and the other peers still run."""
    from harness.peers.mhc_core_peer import mhc_core_peers

    bad = _Raising(name="raising", description="raises in mix", ops=frozenset({"mix", "sinkhorn"}))
    m = run_matrix([bad, mhc_core_peers()[0]])
    row = m.peer("raising")
    errors = [c for c in row.cells() if c.status == "error"]
    assert errors and all(c.op == "mix" for c in errors)
    assert (
        "raising raised RuntimeError in mix (x [6, 2, 8], n=2, torch.float64): kernel exploded"
        in errors[0].message
    )
    assert row.best == "paper" and any(c.status == "pass" for c in row.cells() if c.op == "sinkhorn")
    assert m.peer("mhc_core[paper]").conforms


def test_the_dsv4_branch_gets_a_verdict_on_every_row(matrix):
    """Upstream's dsv4 branch (26b830a6, recorded), adapted by what its module has: no error rows; its API
    generation is named (`h_res_h_post_bda`, a cuTile-only fused module); its fused module is skipped with
    that reason; its Sinkhorn is torchtitan's (`exp(Z - rowmax)`, then (row, column) passes over `sum + eps`),
    so it matches no variant's Sinkhorn at logit scale 10, and it mixes `H @ x`."""
    from harness.conformance.report import format_summary

    row = matrix.peer("megatron_lm[dsv4]")
    assert row.version.startswith("dsv4@26b830a67d25")
    assert not [c for c in row.cells() if c.status == "error"]
    assert "API generation other: config enable_hyper_connections, mix h_res_h_post_bda" in row.description
    cells = {c.check: c for c in row.cells()}
    assert cells["orientation n4 fp32"].observed == "H @ x"
    assert cells["sinkhorn s10 it1 n4 fp32"].status == "fail" and cells["layer n4 fp32"].status == "pass"
    assert "its layers chained by the suite" in cells["stack n4 fp32"].message
    fused = matrix.peer("megatron_lm[dsv4,fused]")
    assert fused.skipped and "needs cuda.tile" in fused.skipped
    assert "    API generation other:" in format_summary(Matrix(peers=(row,)))


@pytest.mark.parametrize(("ratio", "named"), [(1.08, "megatron_main"), (3.0, "megatron_main+fp32_mappings")])
def test_a_label_is_named_only_beyond_half_precision_noise(ratio, named):
    """Two configurations that differ in one bf16 check only: failing at 1.08x its allowance under the plain variant
    (noise) that check does not decide, and the label with fewer options is named; at 3x it decides."""
    from harness.conformance.matrix import Cell, PeerResult

    def cells(status: str, r: float) -> list[Cell]:
        common = [
            Cell(check=f"sinkhorn s1 it20 n4 fp32 #{i}", op="sinkhorn", variant=None, status="pass")
            for i in range(5)
        ]
        grad = Cell(check="stack n4 bf16", op="stack", variant=None, status=status, max_abs=1e-2, ratio=r)
        return [*common, grad]

    row = PeerResult(
        peer="trial",
        description="",
        version=None,
        skipped=None,
        claims=None,
        by_configuration={
            "megatron_main": cells("fail", ratio),
            "megatron_main+fp32_mappings": cells("pass", 0.4),
        },
    )
    assert row.configuration == named
    assert row.configuration_tally("megatron_main") == (5, 6)  # the reported count is unchanged
