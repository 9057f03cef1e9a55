"""MaxText's mHC (JAX, Python >= 3.12: run by the compat env; elsewhere its committed recording replays it): the
layer's configuration, the recording reproduced, and its Pallas kernels (interpret mode) against the oracle and
against MaxText's own XLA path."""

from __future__ import annotations

import json

import pytest
import torch

from harness.conformance.matrix import run_matrix
from harness.conformance.replay import RECORDED_DIR, load_recording
from harness.peers.maxtext import MaxTextPeer, maxtext_config, pallas_config

RECORDING = RECORDED_DIR / "maxtext.json"


@pytest.fixture(scope="module")
def live():
    peer = MaxTextPeer()
    why = peer.unavailable()
    if why:
        pytest.skip(f"maxtext: {why}")
    return run_matrix([peer]).peer(peer.name)


def test_maxtext_layer_is_devs_with_eps_inside_activation_mappings_and_the_learned_exit(live):
    """MaxText's layer: megatron_dev's Sinkhorn and H^T @ x, the eps inside the square root, the mapping in the
    activation dtype (its bf16 checks tell), the learned exit; every fp32 check passes, and in bf16 only its extra
    rounding before the projection shows, within 1.5x the half-precision bound."""
    assert live.configuration == "megatron_dev+eps_inside_sqrt+activation_mappings+learned_exit"
    failing = {c.check: c for c in live.cells() if c.status not in ("pass", "n/a")}
    assert all("bf16" in k for k in failing), failing
    assert all(c.ratio < 1.5 for c in failing.values()), {k: c.ratio for k, c in failing.items()}
    fp32 = [c for c in live.cells() if "fp32" in c.check]
    assert fp32 and all(c.status == "pass" for c in fp32)


def test_the_committed_recording_is_what_maxtext_computes_here(live):
    """maxtext[recorded] (what `mhc-harness conformance` replays on Python 3.11) gives the live run's verdicts,
    from the same package files."""
    (recorded,) = load_recording(RECORDING)
    source = json.loads(RECORDING.read_text())["source"]
    assert source["files_sha256"] == MaxTextPeer().files().hashes(), (
        "maxtext's files changed: re-record (docs/conformance.md)"
    )
    row = run_matrix([recorded]).peer(recorded.name)
    assert row.configuration == live.configuration
    assert [c.status for c in row.cells()] == [c.status for c in live.cells()]


def _streams(t, n, c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, n, c, generator=g, dtype=torch.float64)


def test_pallas_fused_mix_is_the_transposed_mix_forward_and_backward(live):
    """MaxText's Pallas post kernel (interpret mode, bf16, C 128) is `h_post * y + H^T @ x` with its gradients,
    against the fp64 oracle of megatron_dev's mix within the bf16 bounds."""
    import jax
    import jax.numpy as jnp
    from maxtext.kernels.mhc import api

    from harness.conformance.oracle import oracle
    from harness.peers.jax_bridge import jax_call
    from mhc_core.testing import assert_close, tolerance

    t, n, c = 8, 4, 128
    x = _streams(t, n, c, 1).to(torch.bfloat16).double().requires_grad_(True)
    y = (
        torch.randn(t, c, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        .to(torch.bfloat16)
        .double()
    )
    y.requires_grad_(True)
    h_post = (
        0.2 + 1.6 * torch.rand(t, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ).requires_grad_(True)
    h_res = (
        0.05 + torch.rand(t, n, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ).requires_grad_(True)
    cfg = pallas_config()

    def post(ya, xa, hp, hr):
        ctx = api.MhcContext(
            x=xa.astype(jnp.bfloat16).reshape(1, t, n, c),
            h_post=hp.reshape(1, t, n),
            residual=hr.reshape(1, t, n, n),
            implementation="mosaic",
        )
        return (api.post(ya.astype(jnp.bfloat16).reshape(1, t, c), ctx, config=cfg)[0],)

    (out,) = jax_call(post, jnp.float32, y, x, h_post, h_res)
    expected = oracle("megatron_dev").mix(h_res, x, h_post, y)
    assert_close("pallas post", out.double(), expected, tolerance(torch.bfloat16, "fwd"))
    cot = torch.randn(t, n, c, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * cot).sum(), (y, x, h_post, h_res))
    want = torch.autograd.grad((expected * cot).sum(), (y, x, h_post, h_res))
    for name, a, e in zip(("grad y", "grad x", "grad h_post", "grad h_res"), got, want, strict=True):
        assert_close(f"pallas post {name}", a, e, tolerance(torch.bfloat16, "bwd"))
    del jax


def test_pallas_mhc_lite_kernels_match_maxtexts_xla_path(live):
    """MaxText's Pallas mHC-lite kernels (`pre` and `post`, forward and backward, interpret mode: the layer itself
    builds them without it, which the CPU backend refuses) against its own layer without the kernels, on the same
    parameters (`_get_mhc_weights`, as the layer's kernel path): within the bf16 bounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from maxtext.common.common_types import HyperConnectionType
    from maxtext.kernels.mhc import api
    from maxtext.layers.mhc import ManifoldConstrainedHyperConnections, get_permutation_matrices

    from harness.peers.maxtext import _mesh
    from mhc_core.testing import assert_close, tolerance

    t, n, c = 8, 4, 128
    x = jnp.asarray(_streams(t, n, c, 6).numpy(), dtype=jnp.bfloat16).reshape(1, t, n, c)
    w = jnp.asarray(
        (torch.randn(c, c, generator=torch.Generator().manual_seed(7)) / c**0.5).numpy(), jnp.bfloat16
    )
    hc = ManifoldConstrainedHyperConnections(
        maxtext_config(n, c, 20, jnp.bfloat16, enable_mhc_lite=True), dim=c, mesh=_mesh(), rngs=nnx.Rngs(0)
    )

    def branch(inputs):
        return jnp.tanh(inputs @ w)

    def xla(xa):
        return hc(lambda z: z, lambda inputs: branch(inputs), xa, HyperConnectionType.MLP_DENSE)[0]

    def kernels(xa):
        perms = jnp.asarray(get_permutation_matrices(n), jnp.bfloat16)
        layer_input, ctx = api.pre(xa, hc._get_mhc_weights(), perms, config=pallas_config())
        return api.post(branch(layer_input), ctx, config=pallas_config())

    def run(f):
        out, vjp = jax.vjp(f, x)
        (grad,) = vjp(jnp.ones_like(out) * 0.01)
        return (torch.from_numpy(np.asarray(out, np.float64)), torch.from_numpy(np.asarray(grad, np.float64)))

    k_out, k_grad = run(kernels)
    r_out, r_grad = run(xla)
    assert_close("pallas mHC-lite output", k_out, r_out, tolerance(torch.bfloat16, "fwd"))
    assert_close("pallas mHC-lite grad x", k_grad, r_grad, tolerance(torch.bfloat16, "bwd"))


def _lite_reference(hc, x: torch.Tensor, w: torch.Tensor, configuration: str) -> torch.Tensor:
    """`mhc_core`'s reference of one mHC-lite connection (`ResidualConstraint.PERMUTATIONS`) around `tanh(y @ w)`,
    with MaxText module `hc`'s parameters: `x [T, n, C]` -> `[T, n, C]`."""
    import numpy as np

    from mhc_core.ops import h_aggregate, h_post_bda
    from mhc_core.ops.mapping import permutation_mapping

    t, n, c = x.shape

    def param(v) -> torch.Tensor:
        return torch.from_numpy(np.asarray(v[...], np.float64)).to(x.dtype)

    weight = torch.cat([param(hc.pre_alpha).T, param(hc.post_alpha).T, param(hc.res_alpha).T])
    bias = torch.cat([param(hc.pre_beta), param(hc.post_beta), param(hc.res_beta)])
    h_pre, h_post, h_res = permutation_mapping(
        x.reshape(t, n * c),
        weight,
        param(hc.pre_alpha_scale),
        param(hc.post_alpha_scale),
        param(hc.res_alpha_scale),
        bias,
        n,
        configuration,
        1e-6,
    )
    y = torch.tanh(h_aggregate(x, h_pre) @ w.to(x.dtype))
    return h_post_bda(h_res, x, h_post, y, None, variant=configuration)


def test_maxtext_mhc_lite_is_the_permutation_mixture(live):
    """MaxText's mHC-lite layer (`enable_mhc_lite`, its XLA path, fp32) is `mhc_core`'s permutation mixture
    (`ResidualConstraint.PERMUTATIONS`) in MaxText's configuration, `megatron_dev+eps_inside_sqrt+activation_mappings`,
    within the fp32 bound."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from maxtext.common.common_types import HyperConnectionType
    from maxtext.layers.mhc import ManifoldConstrainedHyperConnections

    from harness.peers.maxtext import _mesh
    from mhc_core.testing import assert_close, tolerance

    t, n, c = 6, 4, 16
    x = _streams(t, n, c, 8).float()
    w = torch.randn(c, c, generator=torch.Generator().manual_seed(9)) / c**0.5
    hc = ManifoldConstrainedHyperConnections(
        maxtext_config(n, c, 20, jnp.float32, enable_mhc_lite=True), dim=c, mesh=_mesh(), rngs=nnx.Rngs(3)
    )
    wj = jnp.asarray(w.numpy())
    out, _ = hc(
        lambda z: z,
        lambda inputs: jnp.tanh(inputs @ wj),
        jnp.asarray(x.numpy()).reshape(1, t, n, c),
        HyperConnectionType.MLP_DENSE,
    )
    theirs = torch.from_numpy(np.asarray(out[0], np.float64))
    ours = _lite_reference(hc, x, w, "megatron_dev+eps_inside_sqrt+activation_mappings")
    assert_close(
        "maxtext mHC-lite vs the permutation mixture", theirs, ours.double(), tolerance(torch.float32, "fwd")
    )
    wrong = _lite_reference(hc, x, w, "megatron_dev+eps_inside_sqrt+activation_mappings+untransposed_mix")
    assert (theirs - wrong.double()).abs().max() > 1e-3  # the comparison sees the mix's orientation
