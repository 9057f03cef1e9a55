"""NeMo Automodel's DeepSeek-V4 mHC as a peer (`nemo-automodel` 0.7.0, its torch path, CPU).

What runs is NeMo Automodel's own code, `nemo_automodel.components.models.deepseek_v4`:
`layers.DeepseekV4HyperConnection` (the coefficients: `F.rms_norm` of the flattened streams, the
packed projection `fn`, `pre = sigmoid + hc_eps`, `post = 2 sigmoid`, the combination through
`optimized_kernels.dsv4_sinkhorn_normalize`), that Sinkhorn itself on its torch backend,
`layers.DeepseekV4HyperHead` (the block exit), and `model.DeepseekV4Block.forward` (the collapse of
the streams with `pre` and the expansion `post * out + comb^T @ streams` of both sites) with the
block's attention, MoE and norms replaced by the check's functions. The block is the model's
layer; the suite chains it for `stack` (the model's own forward needs its embedding, rotary and
attention masks, none of them mHC).

Parameter map (reference -> NeMo Automodel, as Hugging Face's DeepSeek-V4, which it ports):
`mapping_proj.weight` `[N, n*C]` -> `fn` (`[pre | post | res]` rows), `bias` -> `base`,
`(alpha_pre, alpha_post, alpha_res)` -> `scale[3]`; the learned exit -> `hc_fn / hc_base /
hc_scale`. Layout: `[T, n, C]` -> `[1, T, n, C]`.

The aggregate and the mix have no entry point of their own: they run through the block's forward
with its hyper connections returning given coefficients (the aggregate: `post = 0, comb = I` at the
attention site, whose stand-in records its input; the mix: the given `post, comb` there and the
identity at the FFN site).

Installed without its dependencies (`harness/requirements-serving.txt` says why): these modules
import with the suite's torch and transformers.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from harness.peers.base import Peer, Sublayer, SublayerParams, bind_tensors

__all__ = ["NemoAutomodelPeer", "VERSION"]

VERSION = "0.7.0"
"""The nemo-automodel release this adapter is written against."""

EPS = 1e-6
"""`hc_eps` and `rms_norm_eps` of the checks (DeepSeek-V4's config values)."""

_PACKAGE = "nemo_automodel.components.models.deepseek_v4"


def _hyper_connection(n: int, c: int, iterations: int, params: SublayerParams) -> nn.Module:
    """NeMo's `DeepseekV4HyperConnection` with the reference's parameters bound (autograd reaches them)."""
    from nemo_automodel.components.models.deepseek_v4.layers import DeepseekV4HyperConnection

    hc = DeepseekV4HyperConnection(
        hc_mult=n, hidden_size=c, hc_sinkhorn_iters=iterations, hc_eps=EPS, rms_norm_eps=EPS
    )
    return bind_tensors(hc, fn=params.weight, base=params.bias, scale=params.alphas())


class _Fixed(nn.Module):
    """A hyper connection that returns given `(pre, post, comb)`."""

    def __init__(self, pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        super().__init__()
        self.out = (pre, post, comb)

    def forward(self, hidden_streams: torch.Tensor):
        return self.out


class _Attention(nn.Module):
    """The attention site's stand-in: `f` of the collapsed streams `[1, T, C]`; records its input."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.f = f
        self.seen: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        self.seen = hidden_states
        return self.f(hidden_states.reshape(-1, hidden_states.shape[-1])).reshape(hidden_states.shape), None


class _Mlp(nn.Module):
    """The FFN site's stand-in (the MoE's place): `f` of the collapsed streams."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor, padding_mask=None):
        return self.f(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def _block(n: int, attn_hc: nn.Module, attn: nn.Module, ffn_hc: nn.Module, mlp: nn.Module) -> nn.Module:
    """NeMo's `DeepseekV4Block` at `n` streams with its sublayers and norms replaced (its forward is the real one)."""
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4Block

    block = DeepseekV4Block.__new__(DeepseekV4Block)
    nn.Module.__init__(block)
    block.layer_idx, block.hc_mult = 0, n
    block.is_hash_routing_layer, block.is_vision_routing = False, False
    block.attn_hc, block.ffn_hc = attn_hc, ffn_hc
    block.self_attn, block.mlp = attn, mlp
    block.input_layernorm, block.post_attention_layernorm = nn.Identity(), nn.Identity()
    return block


def _run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`[T, n, C]` through the block's forward (no position embeddings: the stand-ins take none)."""
    return block(x.unsqueeze(0), position_embeddings=None)[0]


def _zero(h: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(h)


@dataclass(frozen=True, kw_only=True)
class NemoAutomodelPeer(Peer):
    """NeMo Automodel's DeepSeek-V4 mHC (see the module docstring)."""

    name: str = "nemo_automodel"
    description: str = (
        "NeMo Automodel DeepSeek-V4: DeepseekV4HyperConnection, dsv4_sinkhorn_normalize (torch), DeepseekV4HyperHead, "
        "DeepseekV4Block.forward"
    )
    ops: frozenset[str] = frozenset({"coefficients", "aggregate", "mix", "sinkhorn", "layer", "block_exit"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # its mHC computes in fp32 whatever the input
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "F.rms_norm puts eps inside the square root (x * rsqrt(mean(x^2) + eps)); the reference "
            "adds eps to the RMS: the same below fp32 rounding at RMS ~1, visible at small RMS",
        }
    )

    def version(self) -> str | None:
        try:
            return md.version("nemo-automodel")
        except md.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("nemo_automodel") is None:
            return (
                f"nemo-automodel is not installed (pip install --no-deps nemo-automodel=={VERSION}; tox -e "
                "conformance has it)"
            )
        try:
            importlib.import_module(f"{_PACKAGE}.model")
        except Exception as e:  # noqa: BLE001 - any import failure is the reason the row gives
            return (
                f"nemo-automodel {self.version()}: {_PACKAGE}.model does not import: {type(e).__name__}: {e}"
            )
        return None

    def coefficients(self, x, params, iterations):
        t, n, c = x.shape
        pre, post, comb = _hyper_connection(n, c, iterations, params)(x.unsqueeze(0))
        return {"h_pre": pre[0], "h_post": post[0], "h_res": comb[0]}

    def sinkhorn(self, logits, iterations):
        from nemo_automodel.components.models.deepseek_v4.optimized_kernels import dsv4_sinkhorn_normalize

        return dsv4_sinkhorn_normalize(logits, backend="torch", repeat=iterations, eps=EPS)

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        eye = torch.eye(n, dtype=x.dtype).expand(1, t, n, n)
        zeros = torch.zeros(1, t, n, dtype=x.dtype)
        attn = _Attention(_zero)
        _run_block(
            _block(n, _Fixed(h_pre.unsqueeze(0), zeros, eye), attn, _Fixed(zeros, zeros, eye), _Mlp(_zero)), x
        )
        assert attn.seen is not None
        return attn.seen[0]

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        eye = torch.eye(n, dtype=residual.dtype).expand(1, t, n, n)
        zeros = torch.zeros(1, t, n, dtype=residual.dtype)
        attn_hc = _Fixed(
            torch.full((1, t, n), 0.5, dtype=residual.dtype), h_post.unsqueeze(0), h_res.unsqueeze(0)
        )
        return _run_block(
            _block(n, attn_hc, _Attention(lambda _: y), _Fixed(zeros, zeros, eye), _Mlp(_zero)), residual
        )

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        t, n, c = x.shape
        block = _block(
            n,
            _hyper_connection(n, c, iterations, attn.params),
            _Attention(attn.f),
            _hyper_connection(n, c, iterations, mlp.params),
            _Mlp(mlp.f),
        )
        return _run_block(block, x)

    def block_exit(self, x, head_fn, head_base, head_scale):
        from nemo_automodel.components.models.deepseek_v4.layers import DeepseekV4HyperHead

        t, n, c = x.shape
        head = DeepseekV4HyperHead(hc_mult=n, hidden_size=c, hc_eps=EPS, rms_norm_eps=EPS)
        return bind_tensors(head, hc_fn=head_fn, hc_base=head_base, hc_scale=head_scale)(x.unsqueeze(0))[0]
