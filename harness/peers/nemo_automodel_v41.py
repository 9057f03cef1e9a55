"""NeMo Automodel's DeepSeek-V4.1 single-pass mHC as a peer (`nemo-automodel` 0.7.0, its torch path, CPU).

What runs is NeMo Automodel's own code, `nemo_automodel.components.models.deepseek_v41.layers`:
`DeepseekV41HyperConnection.forward` (the coefficients in fp32: the packed projection `fn` times
`rsqrt(mean(x^2) + eps)`, `addcmul` with `scale` and `base`, `pre = sigmoid + hc_eps`, `post = 2 sigmoid`, the
combination through `dsv4_sinkhorn_normalize` on its torch backend), `collapse` (the layer input: the streams
weighted with the *previous* sublayer's `pre`, in fp32) and `expand` (`post * out + comb^T @ streams`). The model
(`model.DeepseekV41Model.forward`) starts the handoff with a one-hot `pre_mix` (stream 0) and each block collapses
its attention input with the `pre_mix` it is handed and its FFN input with the attention site's `pre`: the entry
check gets that one-hot mix, as the model gives it. `single_pass_stack` is the model's composition itself: each
layer is `model.DeepseekV41Block.forward` (its attention, MoE and norms replaced by the check's functions, no
Engram), handed the `pre_mix` the previous block returned (the one-hot first), and the exit is the model's
`collapse` with the last one.

Parameter map (reference -> NeMo Automodel): `mapping_proj.weight` `[N, n*C]` -> `fn`, `bias` -> `base`,
`(alpha_pre, alpha_post, alpha_res)` -> `scale[3]`. Layout: `[T, n, C]` -> `[1, T, n, C]`. The config's
`rms_norm_eps` (default 1e-20 in 0.7.0's `DeepseekV41TextConfig`) and `hc_eps` are set to the checks' 1e-6.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from harness.peers.base import Peer, Sublayer, SublayerParams, bind_tensors
from harness.peers.nemo_automodel import EPS, VERSION, NemoAutomodelPeer

__all__ = ["NemoAutomodelV41Peer"]

_MODULE = "nemo_automodel.components.models.deepseek_v41.layers"


def _hyper_connection(n: int, c: int, iterations: int, params: SublayerParams | None) -> nn.Module:
    """NeMo's `DeepseekV41HyperConnection` with the reference's parameters bound (autograd reaches them)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    config = DeepseekV41TextConfig(
        hidden_size=c, hc_mult=n, hc_sinkhorn_iters=iterations, hc_eps=EPS, rms_norm_eps=EPS
    )
    hc = DeepseekV41HyperConnection(config)
    if params is None:
        return hc
    return bind_tensors(hc, fn=params.weight, base=params.bias, scale=params.alphas())


def _collapse(streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """NeMo's `DeepseekV41HyperConnection.collapse`: `[1, T, n, C]` weighted with `pre_mix [1, T, n]` -> `[1, T, C]`."""
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    return DeepseekV41HyperConnection.collapse(streams, pre_mix)


class _Attention(nn.Module):
    """The attention site's stand-in: `f` of the collapsed streams `[1, T, C]`, the state passed through."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.f = f

    def forward(self, hidden_states: torch.Tensor, *, state=None, **kwargs):
        out = self.f(hidden_states.reshape(-1, hidden_states.shape[-1])).reshape(hidden_states.shape)
        return SimpleNamespace(hidden_states=out, state=state)


class _Ffn(nn.Module):
    """The FFN site's stand-in (the MoE's place): `f` of the collapsed streams; `gate` is no vision gate."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.f = f
        self.gate = None

    def forward(self, x: torch.Tensor, padding_mask=None):
        return self.f(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def _block(attn: Sublayer, mlp: Sublayer, iterations: int) -> nn.Module:
    """NeMo's `DeepseekV41Block` with its hyper connections bound to the check's parameters and its sublayers and
    norms replaced (its forward is the real one)."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41Block

    n = attn.params.n
    c = attn.params.weight.shape[1] // n
    block = DeepseekV41Block.__new__(DeepseekV41Block)
    nn.Module.__init__(block)
    block.attn_hc = _hyper_connection(n, c, iterations, attn.params)
    block.ffn_hc = _hyper_connection(n, c, iterations, mlp.params)
    block.attn, block.ffn = _Attention(attn.f), _Ffn(mlp.f)
    block.attn_norm, block.ffn_norm = nn.Identity(), nn.Identity()
    block.engram = None
    return block


@dataclass(frozen=True, kw_only=True)
class NemoAutomodelV41Peer(Peer):
    """NeMo Automodel's DeepSeek-V4.1 hyper connection (see the module docstring)."""

    name: str = "nemo_automodel[v4.1]"
    description: str = (
        f"NeMo Automodel {VERSION} deepseek_v41.layers.DeepseekV41HyperConnection forward / collapse / expand "
        "(single-pass, torch path)"
    )
    ops: frozenset[str] = frozenset({"single_pass", "aggregate", "mix", "single_pass_stack"})
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    """fp32 (its coefficients are fp32 whatever the streams, so fp64 would be rounded) and bf16, its training dtype."""
    claims: str | None = "megatron_dev+eps_inside_sqrt"
    """DeepSeek-V4.1's numerics as the checks tell them (the fp32 coefficients do not show)."""
    differences: dict[str, str] = field(
        default_factory=lambda: {
            "coefficients": "single-pass: its coefficients come with the previous pre_mix's collapse (the "
            "single-pass checks); V4's per-sublayer connection is the nemo_automodel row",
        }
    )

    def version(self) -> str | None:
        return NemoAutomodelPeer().version()

    def unavailable(self) -> str | None:
        why = NemoAutomodelPeer().unavailable()
        if why:
            return why
        try:
            importlib.import_module(_MODULE)
        except Exception as e:  # noqa: BLE001 - any import failure is the reason the row gives
            return f"nemo-automodel {self.version()}: {_MODULE} does not import: {type(e).__name__}: {e}"
        return None

    def single_pass(self, x, previous_h_pre, params: SublayerParams, iterations):
        t, n, c = x.shape
        hc = _hyper_connection(n, c, iterations, params)
        streams = x.unsqueeze(0)
        mix = hc(streams)
        if previous_h_pre is None:  # the model's start: a one-hot pre_mix on stream 0
            previous_h_pre = torch.zeros(t, n, dtype=torch.float32)
            previous_h_pre[:, 0] = 1
        aggregate = _collapse(streams, previous_h_pre.unsqueeze(0))
        return {
            "aggregate": aggregate[0],
            "next_h_pre": mix.pre[0],
            "h_post": mix.post[0],
            "h_res": mix.comb[0],
        }

    def aggregate(self, x, h_pre):
        return _collapse(x.unsqueeze(0), h_pre.unsqueeze(0))[0]

    def mix(self, h_res, residual, h_post, y):
        """`expand` with the given coefficients in fp32, as its `forward` returns them."""
        from nemo_automodel.components.models.deepseek_v41.layers import (
            DeepseekV41HyperConnection,
            DeepseekV41Mix,
        )

        mix = DeepseekV41Mix(
            pre=torch.zeros_like(h_post, dtype=torch.float32).unsqueeze(0),
            post=h_post.float().unsqueeze(0),
            comb=h_res.float().unsqueeze(0),
        )
        return DeepseekV41HyperConnection.expand(y.unsqueeze(0), residual.unsqueeze(0), mix)[0]

    def single_pass_stack(self, h, layers: Sequence[tuple[Sublayer, Sublayer]], iterations):
        """`h [T, C] -> [T, C]`: n copies of `h` (the model's expansion), its blocks handing `pre_mix` on (a one-hot
        on stream 0 first, in fp32 as the block requires), the model's `collapse` with the last."""
        t, c = h.shape
        n = layers[0][0].params.n
        x = h.unsqueeze(0).unsqueeze(2).expand(1, t, n, c)
        pre_mix = torch.zeros(1, t, n, dtype=torch.float32)
        pre_mix[..., 0] = 1
        state = None
        for attn, mlp in layers:
            x, pre_mix, state = _block(attn, mlp, iterations)(x, pre_mix, state, position_ids=None)
        return _collapse(x, pre_mix)[0]
