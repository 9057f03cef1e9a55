"""What the perf suite times of each peer, beside ours on the same inputs: the peers' natural entry points.

Each peer's timed forms live in its one home, its adapter (`harness.peers.<name>`: `Peer.timing` says which
ops and beside which configuration of ours, `Peer.timed` builds the calls; the table of ops and their inputs
is in `harness.peers.base`); the peers timed are those of the conformance registry that have a `timing`
(`registry_peers`), so a new peer is its adapter plus its registry line, checked and timed. This module sets the
sizes (`PeerCase`), ours beside them, the conformance gate and the row's figures.

Ours run the configuration the peer's `timing` names (`megatron_dev` for DeepSeek-V4 and TileKernels, `paper`
for lucidrains' Sinkhorn, the configurations the matrix finds for TE and Liger). Before a peer is timed at a
shape, its outputs there are compared with our reference's (`PeerTimed.conforms_at`): a peer is timed only
where it conforms. Bytes: `mhc_core.analysis.bytes_moved` of the ops ours runs (`layer_mhc`: twice
coefficients + `h_post_bda` without bias).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from harness import TimingCheck
from harness.peers.base import Peer
from mhc_core.analysis import bytes_moved
from mhc_core.kernels import dispatch
from mhc_core.testing import tolerance
from suites.perf.timing import copy_fn
from tools.perf_cases import ITERATIONS

__all__ = [
    "SMOKE_ENV_VAR",
    "LOW_PRECISION_FACTOR",
    "PeerCase",
    "PeerTimed",
    "conforms",
    "peer_cases",
    "paired_fns",
    "peer_golden",
    "peer_golden_case",
    "peer_info",
    "ours",
    "registry_peers",
    "runner",
    "iterations_for",
    "smoke",
    "timed_peers",
]

_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True, kw_only=True)
class PeerCase:
    """One peer-comparable op at one size."""

    op: str
    tokens: int
    n: int
    hidden: int
    dtype: torch.dtype
    device: str

    @property
    def id(self) -> str:
        size = (
            f"T{self.tokens}-n{self.n}"
            if self.op == "sinkhorn"
            else f"T{self.tokens}-n{self.n}-C{self.hidden}"
        )
        return f"{self.op}-{size}-{_DTYPE_NAME[self.dtype]}"

    def bytes(self, direction: str) -> int:
        act = torch.empty((), dtype=self.dtype).element_size()

        def b(op: str, d: str) -> int:
            return bytes_moved(
                op, d, tokens=self.tokens, n=self.n, hidden=self.hidden, act_bytes=act, with_bias=False
            ).total

        dirs = ("fwd",) if direction == "fwd" else ("fwd", "bwd")
        if self.op == "sinkhorn":
            return sum(b("sinkhorn", d) for d in dirs)
        coeff = sum(b(op, d) for op in ("mapping", "sinkhorn", "h_aggregate") for d in dirs)
        if self.op == "coefficients":
            return coeff
        return 2 * (coeff + sum(b("h_post_bda", d) for d in dirs))

    def inputs(self, requires_grad: bool) -> dict[str, torch.Tensor]:
        """Seeded inputs: streams `x [T, n, C]` in the case dtype, fp32 parameters (two sets for the
        layer), fp32 `logits [T, n, n]` for Sinkhorn."""
        g = torch.Generator().manual_seed(0)
        t, n, c = self.tokens, self.n, self.hidden
        big = n * n + 2 * n

        def rnd(*shape, dtype=torch.float32, scale=1.0):
            x = (torch.randn(*shape, generator=g) * scale).to(device=self.device, dtype=dtype)
            return x.requires_grad_(requires_grad)

        if self.op == "sinkhorn":
            return {"logits": rnd(t, n, n)}
        out = {"x": rnd(t, n, c, dtype=self.dtype)}
        for k in range(2 if self.op == "layer_mhc" else 1):
            out.update(
                {
                    f"w{k}": rnd(big, n * c, scale=0.05),
                    f"a{k}": rnd(3, scale=0.5),
                    f"b{k}": rnd(big, scale=0.5),
                }
            )
        return out


SMOKE_ENV_VAR = "MHC_PERF_SMOKE"
"""`1`: CI's smoke run (`ci/test.sh`): T 256 at C 512, fp32 only, DeepSeek-V4 compiled for its coefficients only
(each compile costs tens of seconds on two cores): every peer's timed path runs, no figure is a measurement."""


def smoke() -> bool:
    return os.environ.get(SMOKE_ENV_VAR) == "1"


SMOKE_ITERATIONS = 4
"""Sinkhorn iterations of a smoke run's rows on CPU (ours unroll them into compiled graphs: 20 cost CI a cold compile
of tens of seconds per row; the figures are no measurement either way)."""


def iterations_for(case: PeerCase) -> int:
    """Sinkhorn iterations of `case`'s rows, ours and the peer's: upstream's default 20, `SMOKE_ITERATIONS` in a
    smoke run on CPU."""
    return SMOKE_ITERATIONS if smoke() and case.device == "cpu" else ITERATIONS


def peer_cases(device: str, *, smoke_run: bool | None = None) -> list[PeerCase]:
    """The sizes: the CPU perf registry's largest fp32 and bf16 (T 4096, C 1024 fp32 and 2048 bf16); on a
    GPU T 8192, C 4096, bf16; in a smoke run (`smoke_run`, by default `MHC_PERF_SMOKE=1`) T 256 at C 512
    fp32."""
    if device == "cuda":
        sizes, tokens = ((4096, torch.bfloat16),), 8192
    elif smoke() if smoke_run is None else smoke_run:
        sizes, tokens = ((512, torch.float32),), 256
    else:
        sizes, tokens = ((1024, torch.float32), (2048, torch.bfloat16)), 4096
    out = [
        PeerCase(op=op, tokens=tokens, n=4, hidden=c, dtype=dt, device=device)
        for op in ("coefficients", "layer_mhc")
        for c, dt in sizes
    ]
    out.append(
        PeerCase(op="sinkhorn", tokens=tokens, n=4, hidden=sizes[0][0], dtype=torch.float32, device=device)
    )
    return out


def _coeffs(o, x, w, a, b, variant, iterations):
    """Our pre-op (mapping, Sinkhorn and aggregate in one, what `HyperConnectionModule` calls)."""
    t, n, c = x.shape
    agg, h_pre, h_post, h_res = o.pre(
        x.reshape(t, n * c), w, a[0:1], a[1:2], a[2:3], b, n, iterations, variant
    )
    return h_pre, h_post, h_res, agg


def ours(case: PeerCase, backend: str, variant: str) -> Callable[[dict[str, torch.Tensor]], tuple]:
    """Our ops on `backend` for `case` in `variant`: `fn(inputs) -> outputs`."""
    from types import SimpleNamespace

    o = SimpleNamespace(**{op: dispatch.op_on(op, backend) for op in dispatch.OPS})
    it = iterations_for(case)
    if case.op == "sinkhorn":
        return lambda d: (o.sinkhorn(d["logits"], it, None, variant),)
    if case.op == "coefficients":

        def coefficients(d):
            _, h_post, h_res, agg = _coeffs(o, d["x"], d["w0"], d["a0"], d["b0"], variant, it)
            return h_post, h_res, agg

        return coefficients

    def layer(d):
        x = d["x"]
        for k in (0, 1):
            _, h_post, h_res, agg = _coeffs(o, x, d[f"w{k}"], d[f"a{k}"], d[f"b{k}"], variant, it)
            x = o.h_post_bda(h_res, x, h_post, agg, None, 0.0, False, variant)
        return (x,)

    return layer


@dataclass(frozen=True, kw_only=True)
class PeerTimed:
    """One timed row: a peer (`Peer.timing`, `Peer.timed`), as is or under `torch.compile`."""

    peer: Peer
    compiled: bool = False

    @property
    def name(self) -> str:
        return f"{self.peer.name}[compiled]" if self.compiled else self.peer.name

    @property
    def conformance_peer(self) -> str:
        """Its row in the conformance matrix."""
        return self.peer.name

    @property
    def variant(self) -> str:
        assert self.peer.timing is not None
        return self.peer.timing.variant

    def unavailable(self, case: PeerCase) -> str | None:
        timing = self.peer.timing
        assert timing is not None
        if timing.gpu_only and case.device != "cuda":
            return f"{self.name} is timed on NVIDIA GPUs only"
        if case.op not in timing.ops:
            return f"{self.name} has no {case.op} entry point"
        if self.compiled and smoke() and case.device != "cuda" and case.op == "layer_mhc":
            return (
                f"{self.name} is not timed in a smoke run (each compile costs tens of seconds on two cores)"
            )
        return self.peer.unavailable()

    def build(self, case: PeerCase) -> Callable[[dict[str, torch.Tensor]], tuple]:
        fn = self.peer.timed(
            case.op, n=case.n, hidden=case.hidden, dtype=case.dtype, iterations=iterations_for(case)
        )
        return torch.compile(fn) if self.compiled else fn

    def conforms_at(self, case: PeerCase) -> tuple[bool, str]:
        """The peer against our reference on this case's inputs (forward): `(ok, worst error text)`."""
        return conforms(self.build(case), case, self.variant)

    def beside(self, variant: str) -> PeerTimed:
        """This row compared and timed beside `variant` instead of its timing's (a wrong one must fail)."""
        assert self.peer.timing is not None
        timing = dataclasses.replace(self.peer.timing, variant=variant)
        return dataclasses.replace(self, peer=dataclasses.replace(self.peer, timing=timing))


LOW_PRECISION_FACTOR = 2.0
"""In a low-precision dtype a peer also conforms where its worst error against the exact (fp64) result is
within this factor of our reference's own in the same dtype (FlashAttention's rule): a sum of terms much
larger than itself (the layer's mix, up to |x| ~ 40 cancelling to ~0.02) misses any bound relative to the
result, on both sides alike."""


def conforms(
    fn: Callable[[dict[str, torch.Tensor]], tuple], case: PeerCase, variant: str
) -> tuple[bool, str]:
    """`fn`'s outputs (ours' order) against our reference in `variant` on the case's inputs, forward: within
    the activation dtype's bound elementwise, or, in a low-precision dtype, with a worst error against the
    fp64 reference at most `LOW_PRECISION_FACTOR` times our reference's in that dtype (+ the bound's atol):
    `(ok, worst error text)`."""
    d = case.inputs(requires_grad=False)
    with torch.no_grad():
        got, want = fn(d), ours(case, "reference", variant)(d)
    worst, text = 0.0, ""
    tol = tolerance(case.dtype, "proj")  # the activation dtype bounds both sides' rounding
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        a64, e64 = a.detach().double().reshape(e.shape), e.detach().double()
        ratio = float(((a64 - e64).abs() / (tol.atol + tol.rtol * e64.abs())).max())
        if ratio > worst:
            worst, text = (
                ratio,
                f"output {i}: max abs err {float((a64 - e64).abs().max()):.2e}, {ratio:.3g}x its bound",
            )
    if worst <= 1 or case.dtype == torch.float32:
        return worst <= 1, text or "exact"
    with torch.no_grad():
        exact = ours(case, "reference", variant)({k: v.detach().double() for k, v in d.items()})
    worst_fa, text_fa = 0.0, ""
    for i, (a, e, x) in enumerate(zip(got, want, exact, strict=True)):
        peer_err = float((a.detach().double().reshape(x.shape) - x).abs().max())
        own_err = float((e.detach().double() - x).abs().max())
        ratio = peer_err / (LOW_PRECISION_FACTOR * own_err + tol.atol)
        if ratio > worst_fa:
            worst_fa, text_fa = (
                ratio,
                (
                    f"output {i}: max abs err against fp64 {peer_err:.2e}, ours in "
                    f"{_DTYPE_NAME[case.dtype]} {own_err:.2e}"
                ),
            )
    ok = worst_fa <= 1
    return ok, f"{text}; {text_fa} ({'within' if ok else 'beyond'} {LOW_PRECISION_FACTOR:g}x ours + atol)"


def timed_peers(peers: Sequence[Peer]) -> tuple[PeerTimed, ...]:
    """The timed rows of `peers`: each peer with a `timing`, and its `[compiled]` form where it has one."""
    out: list[PeerTimed] = []
    for p in peers:
        if p.timing is not None:
            out.append(PeerTimed(peer=p))
            if p.timing.compiled:
                out.append(PeerTimed(peer=p, compiled=True))
    return tuple(out)


@functools.cache
def registry_peers() -> tuple[PeerTimed, ...]:
    """The timed rows of every peer of the conformance registry (`harness.conformance.registry.all_peers`)."""
    from harness.conformance.registry import all_peers

    return timed_peers(all_peers())


def peer_golden_case(case: PeerCase, direction: str, peer: str) -> str:
    """The golden case name of a peer row: `peer-<case id>-<direction>-<peer>` with the peer's brackets and
    commas as dashes (a case name is one path component: `hf_deepseek_v4[compiled]` ->
    `hf_deepseek_v4-compiled`)."""
    return f"peer-{case.id}-{direction}-" + re.sub(r"[^A-Za-z0-9_.+-]+", "-", peer).strip("-")


def peer_golden(peer_s: list[float], ours_s: list[float], device: str) -> tuple[dict, dict]:
    """The metrics and checks of a peer row's golden: the peer's time per rep (`iteration-time`) and our
    speed-up over it per paired rep (`speedup-vs-peer`), both in the two-sided band of our own perf goldens
    (15 % slower / 30 % faster). The speed-up, a ratio of two times taken under the same load, is checked
    everywhere; the peer's time only on a GPU, where a hardware key is one device model (a CPU key groups
    machines of different speeds)."""
    window = (1, len(peer_s))
    ratios = [p / o for p, o in zip(peer_s, ours_s, strict=True)]
    checks = {
        "speedup-vs-peer": TimingCheck(
            rel_band_slow=0.15, rel_band_fast=0.30, window=window, higher_is_better=True
        )
    }
    if device == "cuda":
        checks["iteration-time"] = TimingCheck(rel_band_slow=0.15, rel_band_fast=0.30, window=window)
    return {"iteration-time": peer_s, "speedup-vs-peer": ratios}, checks


def peer_info(
    case: PeerCase, direction: str, peer: str, variant: str, timed: list[list[float]], conformance: str
) -> dict:
    """A peer row's `extra_info` from the paired samples `timed = [peer, copy, ours compiled, ours
    reference]` (seconds per rep, one run): times, bytes/s under our bytes model, roofline ratios against
    the copy, our speed-ups over the peer."""
    peer_s, copy_s, ours_s, ref_s = (statistics.median(t) for t in timed)
    nbytes = case.bytes(direction)
    return {
        "op": case.op,
        "direction": direction,
        "backend": peer,
        "peer": peer,
        "shape": case.id,
        "device": case.device,
        "variant": variant,
        "median_s": peer_s,
        "bytes": nbytes,
        "bytes_per_s": nbytes / peer_s,
        "copy_bytes_per_s": nbytes / copy_s,
        "roofline_ratio": copy_s / peer_s,
        "ours_compiled_s": ours_s,
        "ours_reference_s": ref_s,
        "ours_roofline_ratio": copy_s / ours_s,
        "speedup_vs_peer": peer_s / ours_s,
        "reference_speedup_vs_peer": peer_s / ref_s,
        "conformance": conformance,
    }


def paired_fns(
    peer_fn: Callable[[dict[str, torch.Tensor]], tuple],
    case: PeerCase,
    inputs: dict[str, torch.Tensor],
    direction: str,
    variant: str,
) -> list[Callable[[], object]]:
    """The timed calls of a peer row, in the order `peer_info` reads their samples: the peer, a copy of the
    case's bytes, ours on the compiled and on the reference backend in `variant`."""
    return [
        runner(peer_fn, inputs, direction),
        copy_fn(case.bytes(direction), device=case.device),
        runner(ours(case, "compiled", variant), inputs, direction),
        runner(ours(case, "reference", variant), inputs, direction),
    ]


def runner(
    fn: Callable[[dict[str, torch.Tensor]], tuple], inputs: dict[str, torch.Tensor], direction: str
) -> Callable[[], object]:
    """`fn` on `inputs` as one timed call: forward under `no_grad`, or forward + backward to every input
    that requires grad (fixed random cotangents)."""
    if direction == "fwd":

        def fwd():
            with torch.no_grad():
                return fn(inputs)

        return fwd
    leaves = [v for v in inputs.values() if v.requires_grad]
    outs = fn(inputs)
    cot = [torch.randn_like(o) for o in outs]

    def fwdbwd():
        return torch.autograd.grad(fn(inputs), leaves, cot, allow_unused=True)

    return fwdbwd
