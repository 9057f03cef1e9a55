"""The train/serve mismatch of mHC: a serving engine's connection against the trainer's, layer by layer.

A policy trained in Megatron and rolled out in a serving engine is only the same policy if the engine's mHC
computes what the trainer's does. This module runs, from the same parameters and inputs:

- the **trainer** in bf16: `mhc_core`'s reference of the configuration the serving peers implement
  (`TRAINER`, upstream dev / Hugging Face DeepSeek-V4 numerics: fp32 mappings kept in fp32, bf16 streams);
- the **oracle**: the same configuration in fp64;
- each **serving peer** (`harness.peers.sglang`, `harness.peers.vllm`) in bf16, through its own pre / post;

over a stack of `depth` layers (two sublayers each, the deterministic stand-in `tanh(rms_norm(y) @ w)` computed by
the suite in the streams' dtype, the same for everyone: pre-normed, as attention and MLP are, so that the stack
is not chaotic and the errors measure the connection, not the stand-in), and records after each layer the worst relative
error of the streams, `max |a - e| / max |e|`, against the oracle and against the trainer. One connection (the
first sublayer) is reported on its own.

The bound: a serving peer fails when its error against fp64 grows faster with depth than the trainer's own bf16
error (`err(depth_max) / err(depth_min)` over `GROWTH_FACTOR` times the trainer's), or stands above
`LEVEL_FACTOR` times the trainer's at any reported depth (a peer wrong from layer 1 has a flat, large error).
A failing peer is explained by the first op whose error at one layer stands out the same way (`h_res`,
`h_post`, the layer input, the mix), with the conformance matrix's reason where its configuration differs from
the trainer's (eps placement, mix orientation, Sinkhorn form).

Determinism (the same inputs twice give the same bits) and batch invariance (a token alone and in the batch of
`tokens` give the same bits) are checked per peer on one layer.

In the single-pass form (`TrainServeSetup(form="single_pass")`, DeepSeek-V4.1) the trainer is `mhc_core`'s
reference in V4.1's numerics (`SINGLE_PASS_TRAINER`) and each connection carries the mix: a sublayer's layer input
weights the streams with the `H_pre` the previous one returned (stream 0 at the first), so an error in one
sublayer's projection reaches the next one's input; the serving peers are those with a `single_pass` op and a post
(`vllm[v4.1]`: `mhc_pre_delayed_torch` and `mhc_post_torch`), and the first op that differs is looked for among
H_res, H_post, the next H_pre, the layer input and the mix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.conformance.cases import params
from harness.peers.base import Peer, Sublayer, SublayerParams
from harness.peers.mhc_core_peer import MhcCorePeer, sublayer
from harness.peers.pre_post import PrePostPeer
from mhc_core.forms import ConnectionForm
from mhc_core.variants import get_variant

__all__ = [
    "DEPTHS",
    "GROWTH_FACTOR",
    "LEVEL_FACTOR",
    "SINGLE_PASS_TRAINER",
    "TRAINER",
    "PeerMismatch",
    "TrainServeSetup",
    "measure",
    "rel_err",
    "serving_peers",
    "trainer_configuration",
]

TRAINER = "megatron_dev+eps_inside_sqrt"
"""The configuration the serving peers implement and the trainer runs (DeepSeek-V4's, upstream dev's numerics with
the norm's eps inside the square root)."""
SINGLE_PASS_TRAINER = "deepseek_v41"
"""The single-pass form's trainer: DeepSeek-V4.1's numerics (dev's, eps inside the square root, fp32 coefficients)."""
DEPTHS = (1, 8, 32, 61)
"""Depths reported (61: DeepSeek-V4's layer count)."""
GROWTH_FACTOR = 2.0
"""How much faster than the trainer's own bf16 error a serving peer's error may grow from the first to the last
reported depth."""
LEVEL_FACTOR = 4.0
"""How far above the trainer's own bf16 error a serving peer's error may stand at any reported depth."""
_FLOOR = 1e-7
"""Errors below this count as this (bitwise-equal runs have 0): ratios stay finite."""


@dataclass(frozen=True, kw_only=True)
class TrainServeSetup:
    """The measured shape: `n` streams of width `hidden`, `tokens` tokens, `iterations` Sinkhorn iterations,
    errors reported at `depths` (the stack is `max(depths)` layers deep)."""

    n: int = 4
    hidden: int = 64
    tokens: int = 64
    iterations: int = 20
    depths: tuple[int, ...] = DEPTHS
    seed: int = 0
    form: ConnectionForm = ConnectionForm.PER_SUBLAYER
    """`single_pass`: the connections carry the mix (DeepSeek-V4.1; the module docstring)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "form", ConnectionForm(self.form))
        if not self.depths or min(self.depths) < 1 or list(self.depths) != sorted(set(self.depths)):
            raise ValueError(f"TrainServeSetup.depths={self.depths}: increasing depths >= 1 expected")
        for name in ("n", "hidden", "tokens", "iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainServeSetup.{name}={getattr(self, name)}: must be >= 1")
        if (self.n * self.hidden) % 64:
            raise ValueError(
                f"TrainServeSetup: n*hidden = {self.n * self.hidden} must be a multiple of 64 "
                "(sglang's split-K projection kernel asserts it)"
            )


@dataclass(frozen=True, kw_only=True)
class PeerMismatch:
    """One implementation's errors by depth (`vs_fp64[i]`, `vs_trainer[i]` after `depths[i]` layers)."""

    name: str
    version: str | None
    depths: tuple[int, ...]
    vs_fp64: tuple[float, ...]
    vs_trainer: tuple[float, ...]
    connection_vs_fp64: float
    connection_vs_trainer: float
    deterministic: bool
    batch_invariant: bool
    batch_max_abs: float
    """The largest difference between a token's row alone and in the batch (0 when invariant)."""
    passed: bool = True
    reason: str = ""
    """Why it failed the bound (the first op that differs, the configuration's difference), else empty."""
    configuration: str | None = None
    """What the conformance matrix finds it implements."""

    def growth(self) -> float:
        return max(self.vs_fp64[-1], _FLOOR) / max(self.vs_fp64[0], _FLOOR)

    def to_json(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "growth": self.growth()}


@dataclass(frozen=True, kw_only=True)
class _Layers:
    """The stack's parameters (fp32, as the engines and dev keep them) and sublayer weights."""

    subs: list[tuple[SublayerParams, torch.Tensor]] = field(default_factory=list)

    def sublayers(self, dtype: torch.dtype, param_dtype: torch.dtype) -> list[Sublayer]:
        return [Sublayer(params=_cast(p, param_dtype), f=_stand_in(w.to(dtype))) for p, w in self.subs]


def _stand_in(w: torch.Tensor):
    """The sublayer `y [T, C] -> tanh(rms_norm(y) @ w) [T, C]`, in `w`'s dtype."""
    return lambda y: torch.tanh(torch.nn.functional.rms_norm(y, (y.shape[-1],), eps=1e-6) @ w)


def _cast(p: SublayerParams, dtype: torch.dtype) -> SublayerParams:
    return SublayerParams(
        n=p.n,
        weight=p.weight.to(dtype),
        alpha_pre=p.alpha_pre.to(dtype),
        alpha_post=p.alpha_post.to(dtype),
        alpha_res=p.alpha_res.to(dtype),
        bias=p.bias.to(dtype),
    )


def _setup(s: TrainServeSetup) -> tuple[torch.Tensor, _Layers]:
    g = torch.Generator().manual_seed(7919 + s.seed)
    x = torch.randn(s.tokens, s.n, s.hidden, generator=g, dtype=torch.float64).to(torch.bfloat16)
    subs = []
    for _ in range(2 * max(s.depths)):
        p = _cast(params(s.n, s.hidden, g), torch.float32)
        w = (torch.randn(s.hidden, s.hidden, generator=g, dtype=torch.float64) / s.hidden**0.5).to(
            torch.bfloat16
        )
        subs.append((p, w))
    return x, _Layers(subs=subs)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """`max |a - e| / max |e|` in fp64 (inf for a non-finite value)."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))


def trainer_configuration(form: ConnectionForm | str = ConnectionForm.PER_SUBLAYER) -> str:
    """The trainer's configuration in `form`: `TRAINER`, or `SINGLE_PASS_TRAINER` for the single-pass form."""
    return SINGLE_PASS_TRAINER if ConnectionForm(form) == ConnectionForm.SINGLE_PASS else TRAINER


def serving_peers(form: ConnectionForm | str = ConnectionForm.PER_SUBLAYER) -> list[PrePostPeer]:
    """The serving peers whose whole connection runs here (pre and post) in `form`."""
    from harness.peers.sglang import SglangPeer, SglangTritonPeer
    from harness.peers.vllm import VllmPeer, VllmSinglePassPeer

    if ConnectionForm(form) == ConnectionForm.SINGLE_PASS:
        return [VllmSinglePassPeer()]
    return [SglangPeer(), SglangTritonPeer(), VllmPeer()]


def _trainer(form: ConnectionForm) -> MhcCorePeer:
    """`mhc_core`'s reference of the trainer's configuration in `form` (fp64 inputs make it the oracle)."""
    return MhcCorePeer(name="trainer", description="", ops=frozenset(), variant=trainer_configuration(form))


def _connection(
    peer: PrePostPeer | None,
    x: torch.Tensor,
    sub: Sublayer,
    iterations: int,
    form: ConnectionForm = ConnectionForm.PER_SUBLAYER,
    mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One hyper connection around `sub.f` (the peer's pre / post, or (None) `mhc_core`'s reference) and, single-pass,
    the mix it hands on (`mix`: the one it was handed, None at the first)."""
    if form == ConnectionForm.SINGLE_PASS:
        impl = _trainer(form) if peer is None else peer
        out = impl.single_pass(x, mix, sub.params, iterations)
        y = sub.f(out["aggregate"])
        if peer is None:
            nxt = impl.mix(out["h_res"], x, out["h_post"], y)
        else:
            nxt = peer.post(y, x, out["h_post"], out["h_res"])
        return nxt, out["next_h_pre"]
    if peer is None:
        return sublayer(x, sub, iterations, TRAINER), None
    y, h_res, h_post = peer.pre(x, sub.params, iterations)
    return peer.post(sub.f(y), x, h_post, h_res), None


def _run(
    peer: PrePostPeer | None,
    x: torch.Tensor,
    subs: Sequence[Sublayer],
    iterations: int,
    depths: Sequence[int],
    form: ConnectionForm = ConnectionForm.PER_SUBLAYER,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The first connection's output and the streams after each of `depths` layers."""
    first, out, h, mix = None, [], x, None
    with torch.no_grad():
        for i, sub in enumerate(subs):
            h, mix = _connection(peer, h, sub, iterations, form, mix)
            if i == 0:
                first = h
            if i % 2 == 1 and (i + 1) // 2 in depths:
                out.append(h)
    assert first is not None
    return first, out


def _invariance(
    peer: PrePostPeer | None,
    x: torch.Tensor,
    subs: Sequence[Sublayer],
    iterations: int,
    form: ConnectionForm = ConnectionForm.PER_SUBLAYER,
) -> tuple[bool, bool, float]:
    """`(deterministic, batch invariant, max |alone - in batch|)` of one layer of `peer` (None: the trainer)."""

    def layer(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h, mix = _connection(peer, z, subs[0], iterations, form)
            return _connection(peer, h, subs[1], iterations, form, mix)[0]

    a, b = layer(x), layer(x)
    rows = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    diffs = [float((layer(x[i : i + 1])[0].double() - a[i].double()).abs().max()) for i in rows]
    return torch.equal(a, b), max(diffs) == 0.0, max(diffs)


def _first_differing_op(peer: PrePostPeer, x: torch.Tensor, sub: Sublayer, iterations: int) -> str:
    """The first of `h_res`, `h_post`, the layer input and the mix whose one-connection error against fp64 stands
    `LEVEL_FACTOR` above the trainer's, or an empty string."""
    reference = MhcCorePeer(
        name="trainer", description="", ops=frozenset(), variant=TRAINER
    )  # bf16 in: the trainer
    x64, p64 = x.double(), _cast(sub.params, torch.float64)
    with torch.no_grad():
        ref = reference.coefficients(x64, p64, iterations)
        mine = reference.coefficients(x, sub.params, iterations)
        y, h_res, h_post = peer.pre(x, sub.params, iterations)
        theirs = {"h_res": h_res, "h_post": h_post, "aggregate": y}
        for name, what in (
            ("h_res", "H_res (the Sinkhorn output)"),
            ("h_post", "H_post"),
            ("aggregate", "the layer input (H_pre and the aggregate)"),
        ):
            if rel_err(theirs[name], ref[name]) > LEVEL_FACTOR * max(rel_err(mine[name], ref[name]), _FLOOR):
                return f"{what}: {rel_err(theirs[name], ref[name]):.2e} vs the trainer's {rel_err(mine[name], ref[name]):.2e}"
        f = sub.f(y)
        ref_mix = reference.mix(ref["h_res"], x64, ref["h_post"], f.double())
        mix = peer.post(f, x, h_post, h_res)
        trainer_mix = reference.mix(mine["h_res"], x, mine["h_post"], f)
        if rel_err(mix, ref_mix) > LEVEL_FACTOR * max(rel_err(trainer_mix, ref_mix), _FLOOR):
            return f"the mix (H_res, H_post and the streams): {rel_err(mix, ref_mix):.2e} vs the trainer's {rel_err(trainer_mix, ref_mix):.2e}"
    return ""


def _first_differing_single_pass_op(
    peer: PrePostPeer, x: torch.Tensor, sub: Sublayer, iterations: int
) -> str:
    """As `_first_differing_op` for a single-pass connection handed a mix that is not `x`'s own (the fp64 trainer's
    H_pre of the tokens rolled by one, rounded to fp32: a connection that aggregated with its own H_pre would hide
    behind its own): H_res, H_post, the next H_pre, the layer input, then the mix."""
    form = ConnectionForm.SINGLE_PASS
    trainer = _trainer(form)
    x64, p64 = x.double(), _cast(sub.params, torch.float64)
    with torch.no_grad():
        mix = trainer.single_pass(x64.roll(1, dims=0), None, p64, iterations)["next_h_pre"].float()
        ref = trainer.single_pass(x64, mix.double(), p64, iterations)
        mine = trainer.single_pass(x, mix, sub.params, iterations)
        theirs = peer.single_pass(x, mix, sub.params, iterations)
        for name, what in (
            ("h_res", "H_res (the Sinkhorn output)"),
            ("h_post", "H_post"),
            ("next_h_pre", "the next H_pre (the handoff)"),
            ("aggregate", "the layer input (the aggregate with the previous H_pre)"),
        ):
            got, own = rel_err(theirs[name], ref[name]), rel_err(mine[name], ref[name])
            if got > LEVEL_FACTOR * max(own, _FLOOR):
                return f"{what}: {got:.2e} vs the trainer's {own:.2e}"
        f = sub.f(theirs["aggregate"])
        ref_mix = trainer.mix(ref["h_res"], x64, ref["h_post"], f.double())
        got = rel_err(peer.post(f, x, theirs["h_post"], theirs["h_res"]), ref_mix)
        own = rel_err(trainer.mix(mine["h_res"], x, mine["h_post"], f), ref_mix)
        if got > LEVEL_FACTOR * max(own, _FLOOR):
            return f"the mix (H_res, H_post and the streams): {got:.2e} vs the trainer's {own:.2e}"
    return ""


def _configuration(peer: Peer) -> str | None:
    """What the conformance matrix finds the peer implements (None when it cannot tell)."""
    from harness.conformance.matrix import run_matrix

    return run_matrix([peer]).peer(peer.name).configuration


def measure(peers: Sequence[PrePostPeer], setup: TrainServeSetup = TrainServeSetup()) -> list[PeerMismatch]:
    """The trainer's own bf16 row first, then one row per peer that can run here (see the module docstring)."""
    x, layers = _setup(setup)
    depths, form = setup.depths, setup.form
    trainer = trainer_configuration(form)
    subs64 = layers.sublayers(torch.float64, torch.float64)
    subs = layers.sublayers(torch.bfloat16, torch.float32)
    first64, ref = _run(
        None, x.double(), subs64, setup.iterations, depths, form
    )  # the reference in fp64: the oracle
    first_t, trained = _run(None, x, subs, setup.iterations, depths, form)
    det, inv, worst = _invariance(None, x, subs, setup.iterations, form)
    t_fp64 = tuple(rel_err(a, e) for a, e in zip(trained, ref, strict=True))
    rows = [
        PeerMismatch(
            name=f"trainer (mhc_core[{trainer}], bf16)",
            version=None,
            depths=depths,
            vs_fp64=t_fp64,
            vs_trainer=tuple(0.0 for _ in depths),
            connection_vs_fp64=rel_err(first_t, first64),
            connection_vs_trainer=0.0,
            deterministic=det,
            batch_invariant=inv,
            batch_max_abs=worst,
            configuration=trainer,
        )
    ]
    t_growth = rows[0].growth()
    for peer in peers:
        if peer.unavailable():
            continue
        first, got = _run(peer, x, subs, setup.iterations, depths, form)
        det, inv, worst = _invariance(peer, x, subs, setup.iterations, form)
        vs64 = tuple(rel_err(a, e) for a, e in zip(got, ref, strict=True))
        row = PeerMismatch(
            name=peer.name,
            version=peer.version(),
            depths=depths,
            vs_fp64=vs64,
            vs_trainer=tuple(rel_err(a, e) for a, e in zip(got, trained, strict=True)),
            connection_vs_fp64=rel_err(first, first64),
            connection_vs_trainer=rel_err(first, first_t),
            deterministic=det,
            batch_invariant=inv,
            batch_max_abs=worst,
        )
        level = [d for d, p, t in zip(depths, vs64, t_fp64, strict=True) if p > LEVEL_FACTOR * max(t, _FLOOR)]
        growth_bad = row.growth() > GROWTH_FACTOR * t_growth
        configuration = _configuration(peer)
        if level or growth_bad:
            why = (
                [f"error above {LEVEL_FACTOR:g}x the trainer's at depth {', '.join(map(str, level))}"]
                if level
                else []
            )
            if growth_bad:
                why.append(
                    f"grows {row.growth():.3g}x from depth {depths[0]} to {depths[-1]} (the trainer's "
                    f"{t_growth:.3g}x, bound {GROWTH_FACTOR:g}x that)"
                )
            differing = (
                _first_differing_single_pass_op if form == ConnectionForm.SINGLE_PASS else _first_differing_op
            )
            op = differing(peer, x, subs[0], setup.iterations)
            if op:
                why.append(f"first op that differs: {op}")
            if configuration is not None and configuration not in (trainer, get_variant(trainer).name):
                why.append(f"the conformance matrix finds {configuration}, the trainer runs {trainer}")
            row = replace(row, passed=False, reason="; ".join(why), configuration=configuration)
        else:
            row = replace(row, configuration=configuration)
        rows.append(row)
    return rows
