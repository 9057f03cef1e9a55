"""Hugging Face transformers' DeepSeek-V4 mHC as a peer (`transformers` 5.23, pure PyTorch, CPU).

What runs is transformers' own code: `DeepseekV4HyperConnection` (coefficients, Sinkhorn, the
collapse of the streams), `DeepseekV4HyperHead` (the block exit),
`DeepseekV4DecoderLayer.forward` (the residual mix `post * out + comb^T @ streams`), with the
layer's attention, MoE and norms replaced by the check's functions, and for `stack`
`DeepseekV4Model.forward` (the expansion of the embeddings to `hc_mult` streams, the layers, `hc_head`)
with such layers and its final norm left out (it follows the exit and is no part of mHC).

Parameter map (reference -> DeepSeek-V4): `mapping_proj.weight` `[N, n*C]` -> `fn` (the same
`[pre | post | res]` rows), `bias` -> `base`, `(alpha_pre, alpha_post, alpha_res)` -> `scale[3]`;
the learned block exit `head_fn / head_base / head_scale` -> `hc_fn / hc_base / hc_scale`. Layout:
`[T, n, C]` -> `[1, T, n, C]` (`[B, S, N, D]`, stream-major flattening as the reference).

Ops without a standalone entry point upstream are driven through the real module with the projection
zeroed: Sinkhorn of given logits is `fn = 0, scale = 1, base = logits` per matrix, the aggregate
with given `h_pre` is `base_pre = logit(h_pre - hc_eps)`, and the mix with given coefficients is
the decoder layer with its `attn_hc` returning them.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field

import torch
from torch import nn

from harness.peers.base import Head, Peer, Sublayer, SublayerParams, TimedFn, Timing, bind_tensors

__all__ = ["HfDeepseekV4Peer", "VERSION"]

VERSION = "5.23.0"
"""The transformers release this adapter is written against (`pip install transformers==5.23.0`)."""


def _config(n: int, c: int, iterations: int, layers: int = 1):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=c,
        hc_mult=n,
        hc_sinkhorn_iters=iterations,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        moe_intermediate_size=c,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=c,
        n_routed_experts=1,
        num_experts_per_tok=1,
        vocab_size=8,
        num_hidden_layers=layers,
    )


def _hc(n: int, c: int, iterations: int, dtype: torch.dtype):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    return DeepseekV4HyperConnection(_config(n, c, iterations)).to(dtype)


def _load(hc: nn.Module, params: SublayerParams) -> None:
    """Bind the reference's parameters (autograd flows back to them) as the module's fn / base / scale."""
    bind_tensors(hc, fn=params.weight, base=params.bias, scale=params.alphas())


class _Fixed(nn.Module):
    """An `attn_hc` / `ffn_hc` stand-in that returns given `(post, comb, collapsed)`."""

    def __init__(self, post, comb, collapsed):
        super().__init__()
        self.out = (post, comb, collapsed)

    def forward(self, hidden_streams):
        return self.out


class _Attention(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, h, **kwargs):
        return self.f(h.reshape(-1, h.shape[-1])).reshape(h.shape), None


class _Mlp(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, h, input_ids=None):
        return self.f(h.reshape(-1, h.shape[-1])).reshape(h.shape)


def _decoder_layer(attn_hc, attn_f, ffn_hc, mlp_f):
    """transformers' `DeepseekV4DecoderLayer` with its sublayers and norms replaced (its forward is the real one)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    layer = DeepseekV4DecoderLayer.__new__(DeepseekV4DecoderLayer)
    nn.Module.__init__(layer)
    layer.gradient_checkpointing = False
    layer.layer_idx = 0
    layer.attn_hc, layer.ffn_hc = attn_hc, ffn_hc
    # the checks' stand-in sublayers in the places of the model's own (their types are the model's)
    layer.self_attn, layer.mlp = _Attention(attn_f), _Mlp(mlp_f)  # type: ignore[assignment]
    layer.input_layernorm, layer.post_attention_layernorm = nn.Identity(), nn.Identity()  # type: ignore[assignment]
    return layer


@dataclass(frozen=True, kw_only=True)
class HfDeepseekV4Peer(Peer):
    """transformers' DeepSeek-V4 mHC (see the module docstring)."""

    name: str = "hf_deepseek_v4"
    description: str = "Hugging Face transformers DeepseekV4HyperConnection / HyperHead / DecoderLayer"
    ops: frozenset[str] = frozenset(
        {"coefficients", "aggregate", "mix", "sinkhorn", "layer", "block_exit", "stack"}
    )
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # its mHC upcasts to fp32 whatever the input
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "its RMSNorm puts eps inside the square root (x * rsqrt(mean(x^2) + eps)); the reference "
            "adds eps to the RMS: the same below fp32 rounding at RMS ~1, visible at small RMS",
        }
    )
    timing: Timing | None = Timing(
        variant="megatron_dev", ops=frozenset({"coefficients", "layer_mhc"}), compiled=True
    )

    def version(self) -> str | None:
        try:
            return md.version("transformers")
        except md.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("transformers") is None:
            return f"transformers is not installed (pip install transformers=={VERSION}; tox -e conformance has it)"
        try:
            import transformers.models.deepseek_v4.modeling_deepseek_v4  # noqa: F401
        except ImportError as exc:
            return f"transformers {self.version()} has no DeepSeek-V4 ({exc}); {VERSION} has"
        return None

    def coefficients(self, x, params: SublayerParams, iterations):
        t, n, c = x.shape
        hc = _hc(n, c, iterations, x.dtype)
        _load(hc, params)
        post, comb, collapsed = hc(x.unsqueeze(0))
        return {"h_post": post[0], "h_res": comb[0], "aggregate": collapsed[0]}

    def aggregate(self, x, h_pre):
        t, n, c = x.shape
        out = []
        for i in range(t):  # the collapse weights are per module: one module per token
            hc = _hc(n, c, 1, x.dtype)
            zero = torch.zeros_like(hc.fn)
            base = torch.cat([torch.logit(h_pre[i] - hc.hc_eps), torch.zeros(n + n * n, dtype=x.dtype)])
            bind_tensors(hc, fn=zero, base=base, scale=torch.ones(3, dtype=x.dtype))
            out.append(hc(x[i].reshape(1, 1, n, c))[2].reshape(c))
        return torch.stack(out)

    def mix(self, h_res, residual, h_post, y):
        t, n, c = residual.shape
        attn_hc = _Fixed(h_post.unsqueeze(0), h_res.unsqueeze(0), y.unsqueeze(0))
        eye = torch.eye(n, dtype=residual.dtype).expand(1, t, n, n)
        ffn_hc = _Fixed(
            torch.zeros(1, t, n, dtype=residual.dtype), eye, torch.zeros(1, t, c, dtype=residual.dtype)
        )
        layer = _decoder_layer(attn_hc, lambda a: y, ffn_hc, torch.zeros_like)
        return layer(residual.unsqueeze(0))[0]

    def sinkhorn(self, logits, iterations):
        t, n, _ = logits.shape
        out = []
        for i in range(t):
            hc = _hc(n, 1, iterations, logits.dtype)
            base = torch.cat([torch.zeros(2 * n, dtype=logits.dtype), logits[i].reshape(n * n)])
            bind_tensors(
                hc,
                fn=torch.zeros(n * n + 2 * n, n, dtype=logits.dtype),
                base=base,
                scale=torch.ones(3, dtype=logits.dtype),
            )
            out.append(hc(torch.ones(1, 1, n, 1, dtype=logits.dtype))[1].reshape(n, n))
        return torch.stack(out)

    def layer(self, x, attn: Sublayer, mlp: Sublayer, iterations):
        t, n, c = x.shape
        attn_hc, ffn_hc = _hc(n, c, iterations, x.dtype), _hc(n, c, iterations, x.dtype)
        _load(attn_hc, attn.params)
        _load(ffn_hc, mlp.params)
        return _decoder_layer(attn_hc, attn.f, ffn_hc, mlp.f)(x.unsqueeze(0))[0]

    def block_exit(self, x, head_fn, head_base, head_scale):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

        t, n, c = x.shape
        head = DeepseekV4HyperHead(_config(n, c, 1)).to(x.dtype)
        _load_head(head, Head(fn=head_fn, base=head_base, scale=head_scale))
        return head(x.unsqueeze(0))[0]

    def stack(self, h, layers, head: Head, iterations):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model

        t, c = h.shape
        n = layers[0][0].params.n
        model = DeepseekV4Model(_config(n, c, iterations, layers=len(layers))).to(h.dtype)
        for i, (attn, mlp) in enumerate(layers):
            attn_hc, ffn_hc = _hc(n, c, iterations, h.dtype), _hc(n, c, iterations, h.dtype)
            _load(attn_hc, attn.params)
            _load(ffn_hc, mlp.params)
            model.layers[i] = _decoder_layer(attn_hc, attn.f, ffn_hc, mlp.f)
        _load_head(model.hc_head, head)
        model.norm = nn.Identity()
        return model(inputs_embeds=h.unsqueeze(0)).last_hidden_state[0]

    def timed(self, op, *, n, hidden, dtype, iterations) -> TimedFn:
        """`coefficients`: `DeepseekV4HyperConnection.forward`; `layer_mhc`: `DeepseekV4DecoderLayer.forward`
        with its attention, MoE and norms the identity (the module computes in fp32 whatever `dtype`)."""
        hcs = [_hc(n, hidden, iterations, torch.float32) for _ in range(2 if op == "layer_mhc" else 1)]
        for hc in hcs:
            del hc.fn, hc.base, hc.scale

        def bind(d):
            for k, hc in enumerate(hcs):
                hc.fn, hc.base, hc.scale = d[f"w{k}"], d[f"b{k}"], d[f"a{k}"]

        if op == "coefficients":

            def coefficients(d):
                bind(d)
                post, comb, collapsed = hcs[0](d["x"].unsqueeze(0))
                return post[0], comb[0], collapsed[0]

            return coefficients
        layer = _decoder_layer(hcs[0], lambda y: y, hcs[1], lambda y: y)

        def layer_mhc(d):
            bind(d)
            return (layer(d["x"].unsqueeze(0))[0],)

        return layer_mhc


def _load_head(module: nn.Module, head: Head) -> None:
    """Bind the learned exit's parameters as a `DeepseekV4HyperHead`'s hc_fn / hc_base / hc_scale."""
    bind_tensors(module, hc_fn=head.fn, hc_base=head.base, hc_scale=head.scale)
