"""The mHC parameters of a GPT built by `mhc_core.megatron`, in DeepSeek-V4's names, and back.

Two namings (`DeepseekV4Names`): transformers' `DeepseekV4ForCausalLM` modules, and DeepSeek's
released checkpoint (what transformers' loader renames from, and what torchtitan's state-dict adapter
maps to its own `hc_attn_pre.hc_fn`):

| `mhc_core.megatron` (upstream Megatron-LM's names) | `transformers` | `checkpoint` |
|---|---|---|
| `decoder.layers.<i>.self_attention_hyper_connection.mapping_proj.weight` | `model.layers.<i>.attn_hc.fn` | `layers.<i>.hc_attn_fn` |
| `decoder.layers.<i>.self_attention_hyper_connection.bias` | `model.layers.<i>.attn_hc.base` | `layers.<i>.hc_attn_base` |
| `decoder.layers.<i>.self_attention_hyper_connection.alpha_{pre,post,res}` | `model.layers.<i>.attn_hc.scale` `[3]` | `layers.<i>.hc_attn_scale` `[3]` |
| `decoder.layers.<i>.mlp_hyper_connection.*` | `model.layers.<i>.ffn_hc.*` | `layers.<i>.hc_ffn_*` |
| `decoder.hc_head_fn` / `hc_head_base` / `hc_head_scale` | `model.hc_head.hc_fn` / ... | `hc_head_fn` / ... |

The hybrid stack's keys (`mhc_core.megatron.hybrid`, one `decoder.layers.<j>.hyper_connection` per layer, a
pattern of logical layers as DeepSeek-V4's conversion writes them: attention, then MLP or MoE) map through
`hybrid.gpt_key`: hybrid layer 2i is logical layer i's `attn_hc`, 2i+1 its `ffn_hc`.
`to_deepseek_v4` takes either form; `from_deepseek_v4(..., form="hybrid")` writes the hybrid keys.

Both use the `[pre(n) | post(n) | res(n*n row-major)]` layout and stream-major flattening, so the
tensors move unchanged (the three alphas become one `scale` vector). Only the mHC parameters are
converted: attention and MLP weights are the caller's. DeepSeek-V4 computes the `megatron_dev`
convention (softmax-started Sinkhorn with eps, `H_res^T` mix, `h_pre + eps`, learned block exit),
so only a `megatron_dev` model converts; `suites/unit/megatron/test_deepseek_v4_names.py` checks
on a real mini GPT that both sides then give the same coefficients and mixed streams.

DeepSeek-V4.1 (`mhc_single_pass` with the `deepseek_v41` numerics) keeps V4's names and shapes for every
sublayer's `hc_attn_*` / `hc_ffn_*` (vLLM 0.33.0's `deepseek_v41` loader reads the same checkpoint names) and
has no `hc_head`: its exit aggregates with the last `hc_ffn`'s H_pre. So a V4.1 checkpoint is a V4 checkpoint
without `hc_head_*`; which form it runs in is the model's configuration, not a name (a V4 checkpoint loads into
a single-pass model without error: `to_deepseek_v4` / `from_deepseek_v4` refuse a head on a V4.1 model instead).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

import torch

__all__ = ["DeepseekV4Names", "Form", "from_deepseek_v4", "to_deepseek_v4"]


class DeepseekV4Names(enum.StrEnum):
    """Which of DeepSeek-V4's namings (see the module docstring)."""

    TRANSFORMERS = "transformers"
    """transformers' module names (`model.layers.<i>.attn_hc.fn`)."""
    CHECKPOINT = "checkpoint"
    """DeepSeek's released checkpoint (`layers.<i>.hc_attn_fn`), as torchtitan's adapter reads it."""


class Form(enum.StrEnum):
    """Which model's keys: the GPT's (two hyper connections per layer) or the hybrid stack's (one per layer)."""

    GPT = "gpt"
    HYBRID = "hybrid"


_HYBRID = re.compile(r"^(?:module\.)?decoder\.layers\.\d+\.hyper_connection\.")


def _as_gpt(key: str) -> str:
    """A hybrid stack's hyper-connection key as the GPT's (`hybrid.gpt_key`); any other key unchanged."""
    if not _HYBRID.match(key):
        return key
    from mhc_core.megatron.hybrid import gpt_key

    prefix = "module." if key.startswith("module.") else ""
    return prefix + gpt_key(key.removeprefix("module."))


_SUBLAYERS = {"self_attention_hyper_connection": "attn_hc", "mlp_hyper_connection": "ffn_hc"}
_CKPT_SUBLAYERS = {"attn_hc": "hc_attn", "ffn_hc": "hc_ffn"}
_MEGATRON = re.compile(
    r"^(?:module\.)?decoder\.layers\.(\d+)\.(self_attention_hyper_connection|mlp_hyper_connection)\."
    r"(mapping_proj\.weight|bias|alpha_pre|alpha_post|alpha_res)$"
)
_HF = re.compile(r"^model\.layers\.(\d+)\.(attn_hc|ffn_hc)\.(fn|base|scale)$")
_CKPT = re.compile(r"^layers\.(\d+)\.(hc_attn|hc_ffn)_(fn|base|scale)$")
_HEAD = {
    "decoder.hc_head_fn": "model.hc_head.hc_fn",
    "decoder.hc_head_base": "model.hc_head.hc_base",
    "decoder.hc_head_scale": "model.hc_head.hc_scale",
}
_ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")


def _to_checkpoint(key: str) -> str:
    """A transformers name (`model.layers.<i>.attn_hc.fn`, `model.hc_head.hc_fn`) as the checkpoint's."""
    m = _HF.match(key)
    if m:
        return f"layers.{m.group(1)}.{_CKPT_SUBLAYERS[m.group(2)]}_{m.group(3)}"
    return key.removeprefix("model.").replace("hc_head.hc_", "hc_head_")


_CONVERTIBLE = ("megatron_dev", "deepseek_v41")
"""The configurations whose models convert: DeepSeek-V4's convention, and DeepSeek-V4.1's single-pass numerics."""


def to_deepseek_v4(
    state: Mapping[str, torch.Tensor],
    *,
    variant: str,
    names: DeepseekV4Names | str = DeepseekV4Names.TRANSFORMERS,
) -> dict[str, torch.Tensor]:
    """The mHC entries of a `mhc_core.megatron` state dict under DeepSeek-V4's names (`names`: transformers'
    or the released checkpoint's); `variant="deepseek_v41"` for a DeepSeek-V4.1 (single-pass) model, whose
    checkpoint has the same names and no `hc_head`.

    `ValueError` for a `variant` other than `megatron_dev` or `deepseek_v41`, for a sublayer missing one of its
    five parameters (naming the key), for a state dict without mHC parameters, or for a learned head under
    `deepseek_v41`.
    """
    if variant not in _CONVERTIBLE:
        raise ValueError(
            f"variant={variant!r}: DeepSeek-V4 computes megatron_dev's convention (H_res^T mix, "
            "softmax-started Sinkhorn with eps, h_pre + eps), DeepSeek-V4.1 deepseek_v41's; a model of "
            "another variant would compute another function under their names"
        )
    heads = [k for k in state if k.removeprefix("module.") in _HEAD]
    if variant == "deepseek_v41" and heads:
        raise ValueError(
            f"variant='deepseek_v41': {heads[0]} is a learned exit head, which DeepSeek-V4.1 does not "
            "have (its exit aggregates with the last sublayer's H_pre)"
        )
    groups: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        m = _MEGATRON.match(_as_gpt(key))
        if m:
            groups.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    if not groups:
        raise ValueError(
            "no mHC parameters (decoder.layers.<i>.*_hyper_connection.*, or a hybrid stack's "
            "decoder.layers.<j>.hyper_connection.*) in the state dict"
        )
    out: dict[str, torch.Tensor] = {}
    for (i, sub), p in sorted(groups.items()):
        missing = sorted({"mapping_proj.weight", "bias", *_ALPHAS} - set(p))
        if missing:
            raise ValueError(f"decoder.layers.{i}.{sub}: missing {', '.join(missing)}")
        prefix = f"model.layers.{i}.{_SUBLAYERS[sub]}"
        out[f"{prefix}.fn"] = p["mapping_proj.weight"]
        out[f"{prefix}.base"] = p["bias"]
        out[f"{prefix}.scale"] = torch.cat([p[a].reshape(1) for a in _ALPHAS])
    for ours, theirs in _HEAD.items():
        for key in (ours, f"module.{ours}"):
            if key in state:
                out[theirs] = state[key]
    try:
        names = DeepseekV4Names(names)
    except ValueError:
        raise ValueError(f"names={names!r}: valid: {', '.join(n.value for n in DeepseekV4Names)}") from None
    return out if names == DeepseekV4Names.TRANSFORMERS else {_to_checkpoint(k): v for k, v in out.items()}


def _from_checkpoint(key: str) -> str:
    """A checkpoint name as transformers' (the inverse of `_to_checkpoint`; other keys unchanged)."""
    m = _CKPT.match(key)
    if m:
        sub = next(k for k, v in _CKPT_SUBLAYERS.items() if v == m.group(2))
        return f"model.layers.{m.group(1)}.{sub}.{m.group(3)}"
    if key.startswith("hc_head_"):
        return "model.hc_head.hc_" + key.removeprefix("hc_head_")
    return key


def from_deepseek_v4(
    state: Mapping[str, torch.Tensor], *, form: Form | str = Form.GPT
) -> dict[str, torch.Tensor]:
    """The mHC entries of a DeepSeek-V4 state dict (either naming) under `mhc_core.megatron`'s names (a
    `megatron_dev` model's): the GPT's, or with `form="hybrid"` the hybrid stack's; `ValueError` naming a bad
    `scale` shape, an unknown form or an empty result."""
    try:
        form = Form(form)
    except ValueError:
        raise ValueError(f"form={form!r}: valid: {', '.join(f.value for f in Form)}") from None
    inverse = {v: k for k, v in _SUBLAYERS.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = _HF.match(_from_checkpoint(key))
        if m:
            prefix = f"decoder.layers.{m.group(1)}.{inverse[m.group(2)]}"
            if m.group(3) == "fn":
                out[f"{prefix}.mapping_proj.weight"] = value
            elif m.group(3) == "base":
                out[f"{prefix}.bias"] = value
            else:
                if tuple(value.shape) != (3,):
                    raise ValueError(
                        f"{key}: scale must have shape [3] (pre, post, comb), got {list(value.shape)}"
                    )
                for j, a in enumerate(_ALPHAS):
                    out[f"{prefix}.{a}"] = value[j : j + 1].clone()
        elif _from_checkpoint(key) in _HEAD.values():
            out[next(k for k, v in _HEAD.items() if v == _from_checkpoint(key))] = value
    if not out:
        raise ValueError(
            "no DeepSeek-V4 mHC parameters (model.layers.<i>.attn_hc/ffn_hc.*, model.hc_head.*, or the "
            "checkpoint's layers.<i>.hc_attn_*/hc_ffn_*, hc_head_*) in the state dict"
        )
    if form == Form.HYBRID:
        from mhc_core.megatron.hybrid import hybrid_key

        return {hybrid_key(k): v for k, v in out.items()}
    return out
