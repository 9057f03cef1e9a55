"""MaxText's mHC (JAX, `maxtext` 0.2.5) as a peer: its layer on its own arrays, converted at the boundary.

What runs is MaxText's own code (`maxtext/layers/mhc.py`): `ManifoldConstrainedHyperConnections` (its RMSNorm
`mhc_norm`, `mapping`, `res_mapping` and `__call__` around a branch), the module-level `sinkhorn`, and
`DeepSeek4HyperHead` (the block exit), built with a config object holding the fields they read, a one-device
mesh and `nnx.Rngs(0)`, inside the traced function (nnx refuses a parameter set from another trace level). The
reference's parameters are bound into the modules' `nnx.Param`s there, so `jax.vjp` differentiates with respect to them (`harness.peers.jax_bridge`); the sublayers are the
checks' `tanh(y @ w)` written in JAX. MaxText needs Python >= 3.12 (the `compat` env has it, with JAX on CPU):
elsewhere the committed recording `maxtext[recorded]` replays it.

Parameter map (reference -> MaxText): `mapping_proj.weight` `[N, n*C]` -> `pre_alpha` / `post_alpha` /
`res_alpha` `[n*C, n | n | n*n]` (the rows, transposed), `bias` -> `pre_beta [n]` / `post_beta [n]` /
`res_beta [n, n]`, `alpha_pre / post / res` -> `pre_alpha_scale` / `post_alpha_scale` / `res_alpha_scale`;
`mhc_norm.scale` stays ones (the reference's norm has no gain). Learned exit: `head_fn [n, n*C]` -> `hc_fn`
(transposed), `head_base` -> `hc_base`, `head_scale` -> `hc_scale`. Layout: `[T, n, C]` -> `[1, T, n, C]`
(MaxText's expansion axis third), flattened stream-major as the reference.

Its numerics, read off the code: the norm's eps inside the square root (`rsqrt(mean(x^2) + eps)`); the projection,
gates and mix in the activation dtype (`config.dtype`, parameters cast to it), Sinkhorn in fp32 (dev's form:
softmax + eps, a column step, then rows and columns with `sum + eps`) cast back; `sigmoid + 1e-6` pre gate; the
mix `einsum("bskm,bskd->bsmd")`, i.e. `H^T @ x`.

Its Pallas kernels (`maxtext/kernels/mhc/`, forward and backward, bf16, n = 4, C a multiple of 128) implement only
mHC-lite (`enable_mhc_lite`: H_res a softmax-weighted mixture of the n! permutation matrices, `mhc_core`'s
`ResidualConstraint.PERMUTATIONS`, whose `2n + n!` logits the conformance checks' parameters do not have), so
they are not a row of the matrix: `suites/conformance/test_maxtext.py` runs them in Pallas's interpret mode (the
fused mix against the oracle, the mHC-lite pre and post against MaxText's own XLA path), and that XLA path against
`mhc_core`'s permutation mixture.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from harness.peers.base import Peer, Sublayer, SublayerParams
from harness.peers.installed import InstalledFiles
from harness.peers.jax_bridge import jax_call

__all__ = ["LAYER_FILE", "MAXTEXT", "MaxTextPeer", "maxtext_config", "pallas_config"]

LAYER_FILE = "maxtext/layers/mhc.py"
MAXTEXT = InstalledFiles(
    dist="maxtext", version="0.2.5", files=(LAYER_FILE, "maxtext/layers/normalizations.py")
)
_EPS = 1e-6
"""The norm's eps given to MaxText (the reference's `NORM_EPS`); its pre-gate and exit eps are 1e-6 in code."""


_BF16_ROUNDING = (
    "in bf16 it normalises the streams first and rounds them to bf16 before the projection (its "
    "RMSNorm's output dtype), then runs the projection and gates in bf16; the reference projects, then "
    "scales by the RMS: more rounding in its bf16 gradients than the reference's own"
)


def maxtext_config(n: int, c: int, iterations: int, dtype: Any, **overrides: Any) -> SimpleNamespace:
    """The fields MaxText's mHC modules read from its config (`dtype`: a JAX dtype)."""
    import jax.numpy as jnp

    fields = dict(
        sinkhorn_iterations=iterations,
        mhc_expansion_rate=n,
        dtype=dtype,
        weight_dtype=jnp.float32,
        matmul_precision="default",
        enable_mhc_lite=False,
        use_mhc_pallas_kernel=False,
        normalization_layer_epsilon=_EPS,
        emb_dim=c,
    )
    return SimpleNamespace(**{**fields, **overrides})


def pallas_config(block: int = 8) -> Any:
    """MaxText's `MhcKernelConfig` for Pallas's interpret mode (no TPU) at `block` tokens per block."""
    from maxtext.kernels.mhc import common

    return common.MhcKernelConfig(
        block_size=block, bwd_block_size=block, bwd_feature_block_size=128, interpret=True
    )


@cache
def _mesh():
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


def _jdtype(dtype: torch.dtype) -> Any:
    import jax.numpy as jnp

    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float64: jnp.float64}[dtype]


def _hc(n: int, c: int, iterations: int, dtype: Any) -> Any:
    from flax import nnx
    from maxtext.layers.mhc import ManifoldConstrainedHyperConnections

    return ManifoldConstrainedHyperConnections(
        maxtext_config(n, c, iterations, dtype), dim=c, mesh=_mesh(), rngs=nnx.Rngs(0)
    )


def _bind(hc: Any, n: int, w: Any, a: Any, b: Any) -> None:
    """The reference's `weight [N, n*C]`, alphas `[3]` and `bias [N]` into the module's parameters."""
    import jax.numpy as jnp

    hc.pre_alpha[...] = w[:n].T
    hc.post_alpha[...] = w[n : 2 * n].T
    hc.res_alpha[...] = w[2 * n :].T
    hc.pre_alpha_scale[...], hc.post_alpha_scale[...], hc.res_alpha_scale[...] = a[0:1], a[1:2], a[2:3]
    hc.pre_beta[...], hc.post_beta[...] = b[:n], b[n : 2 * n]
    hc.res_beta[...] = jnp.reshape(b[2 * n :], (n, n))


@dataclass(frozen=True, kw_only=True)
class MaxTextPeer(Peer):
    """MaxText's mHC layer (see the module docstring)."""

    name: str = "maxtext"
    description: str = "MaxText 0.2.5 maxtext.layers.mhc ManifoldConstrainedHyperConnections / sinkhorn / DeepSeek4HyperHead (JAX)"
    ops: frozenset[str] = frozenset({"coefficients", "sinkhorn", "layer", "block_exit"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    claims: str | None = "megatron_dev+eps_inside_sqrt+activation_mappings+learned_exit"
    """Its mapping computes in the activation dtype (fp32 in fp32: the bf16 checks tell)."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "aggregate": "no entry point of its own (inside __call__): checked inside coefficients",
            "mix": "no entry point of its own taking given coefficients (inside __call__): checked through layer",
            "coefficients": _BF16_ROUNDING,
            "layer": _BF16_ROUNDING,
        }
    )

    def version(self) -> str | None:
        return MAXTEXT.installed_version()

    def unavailable(self) -> str | None:
        if sys.version_info < (3, 12):
            return (
                f"maxtext needs Python >= 3.12 (this is {sys.version_info.major}.{sys.version_info.minor}; "
                "tox -e compat runs it; maxtext[recorded] replays it here)"
            )
        if importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None:
            return "jax / flax are not installed (tox -e compat has them)"
        why = MAXTEXT.unavailable()
        if why:
            return why
        try:
            import maxtext.layers.mhc  # noqa: F401
        except Exception as exc:  # a broken install is a reason, not a crash
            return f"maxtext.layers.mhc failed to import: {type(exc).__name__}: {exc}"
        return None

    def files(self) -> InstalledFiles:
        return MAXTEXT

    def coefficients(self, x, params: SublayerParams, iterations):
        import jax.numpy as jnp

        t, n, c = x.shape
        jd = _jdtype(x.dtype)

        def fn(xa, w, a, b):
            hc = _hc(
                n, c, iterations, jd
            )  # built inside the trace: nnx refuses a Param set from another trace level
            _bind(hc, n, w, a, b)
            xs = xa.reshape(1, t, n, c)
            norm_x = hc.mhc_norm(jnp.reshape(xs, (1, t, n * c)))
            alpha = jnp.concatenate(
                [
                    jnp.asarray(hc.pre_alpha[...], jd),
                    jnp.asarray(hc.post_alpha[...], jd),
                    jnp.asarray(hc.res_alpha[...], jd),
                ],
                axis=-1,
            )
            h = jnp.einsum("bsm,mn -> bsn", norm_x, alpha, precision=hc.matmul_precision)
            h_pre = hc.mapping(h[..., :n], hc.pre_alpha_scale[...], hc.pre_beta[...], 1.0, eps=1e-6)
            h_post = hc.mapping(h[..., n : 2 * n], hc.post_alpha_scale[...], hc.post_beta[...], 2.0)
            h_res = hc.res_mapping(h[..., 2 * n :])
            agg = jnp.einsum("bsk,bskd->bsd", h_pre, xs, precision=hc.matmul_precision)
            return h_pre[0], h_post[0], h_res[0], agg[0]

        f32 = _jdtype(torch.float32)
        h_pre, h_post, h_res, agg = jax_call(
            lambda xa, w, a, b: fn(xa.astype(jd), w, a, b),
            f32,
            x,
            params.weight,
            params.alphas(),
            params.bias,
        )
        return {"h_pre": h_pre, "h_post": h_post, "h_res": h_res, "aggregate": agg}

    def sinkhorn(self, logits, iterations):
        from maxtext.layers.mhc import sinkhorn

        jd = _jdtype(logits.dtype)
        (out,) = jax_call(lambda z: (sinkhorn(z.astype(jd), iterations),), _jdtype(torch.float32), logits)
        return out

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        import jax.numpy as jnp
        from maxtext.common.common_types import HyperConnectionType

        t, n, c = x.shape
        jd = _jdtype(x.dtype)
        ws = []
        for sub in (attn, mlp):
            if sub.w is None:
                raise ValueError(
                    f"{self.name}: layer needs the sublayer's weight (Sublayer.w): a JAX peer runs the "
                    "stand-in tanh(y @ w) itself"
                )
            ws.append(sub.w)

        def fn(xa, w0, a0, b0, w1, a1, b1, f0, f1):
            h = xa.astype(jd).reshape(1, t, n, c)
            for w, a, b, fw in ((w0, a0, b0, f0), (w1, a1, b1, f1)):
                hc = _hc(n, c, iterations, jd)
                _bind(hc, n, w, a, b)
                branch = lambda inputs, fw=fw: jnp.tanh(inputs @ fw.astype(jd))  # noqa: E731 - the checks' stand-in
                h, _ = hc(lambda y: y, branch, h, HyperConnectionType.MLP_DENSE)
            return (h[0],)

        (out,) = jax_call(
            fn,
            _jdtype(torch.float32),
            x,
            attn.params.weight,
            attn.params.alphas(),
            attn.params.bias,
            mlp.params.weight,
            mlp.params.alphas(),
            mlp.params.bias,
            *ws,
        )
        return out

    def block_exit(self, x, head_fn, head_base, head_scale):
        from flax import nnx
        from maxtext.layers.mhc import DeepSeek4HyperHead

        t, n, c = x.shape
        jd = _jdtype(x.dtype)

        def fn(xa, fn_, base, scale):
            head = DeepSeek4HyperHead(maxtext_config(n, c, 1, jd), mesh=_mesh(), rngs=nnx.Rngs(0))
            head.hc_fn[...], head.hc_base[...], head.hc_scale[...] = fn_.T, base, scale
            return (head(xa.astype(jd).reshape(1, t, n, c))[0],)

        (out,) = jax_call(fn, _jdtype(torch.float32), x, head_fn, head_base, head_scale)
        return out
