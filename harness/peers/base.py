"""The adapter interface every mHC implementation under test implements.

An adapter maps the reference's parameters (`SublayerParams`, upstream Megatron-LM main's
names and layout) and tensor layout (flattened tokens, `[T, n, C]`) onto the peer's own, runs the
peer's own code, and hands the results back in the reference's layout. Gradients flow through
autograd: the checks differentiate what an op returns with respect to what it was given.

Ops (a peer implements those in `Peer.ops`):

| op | signature | returns |
|---|---|---|
| `coefficients` | `(x [T, n, C], params, iterations)` | dict, below |
| `aggregate` | `(x [T, n, C], h_pre [T, n])` | `[T, C]` |
| `mix` | `(h_res [T, n, n], residual [T, n, C], h_post [T, n], y [T, C])` | `[T, n, C]` |
| `sinkhorn` | `(logits [T, n, n], iterations)` | `[T, n, n]` |
| `layer` | `(x [T, n, C], attn, mlp, iterations)`: two sublayers | `[T, n, C]` |
| `block_exit` | `(x [T, n, C], head_fn [n, n*C], head_base [n], head_scale [1])` | `[T, C]` |
| `stack` | `(h [T, C], layers, head, iterations)`: `layers` a sequence of `(attn, mlp)` `Sublayer` pairs, `head` a `Head` | `[T, C]` |
| `single_pass` | `(x [T, n, C], previous_h_pre [T, n] or None, params, iterations)`: one single-pass (DeepSeek-V4.1) sublayer's pre-op | dict, below |
| `single_pass_stack` | `(h [T, C], layers, iterations)`: the peer's own single-pass composition, the handoff between its sublayers, the exit with the last H_pre | `[T, C]` |

`coefficients` returns the subset of `{"h_pre" [T, n], "h_post" [T, n], "h_res" [T, n, n]
(after Sinkhorn), "aggregate" [T, C]}` the peer exposes (DeepSeek-V4 consumes `h_pre` itself and
returns the aggregate). `layer` runs attention-like then MLP-like sublayers,
`x -> mix(x, f(aggregate(x)))` twice, with `attn` / `mlp` a `Sublayer` each.
`block_exit` is the learned contraction of `megatron_dev` / DeepSeek-V4 (`hc_head`).
`single_pass` returns the subset of `{"aggregate" [T, C] (the streams weighted with `previous_h_pre`; stream 0
when it is None, the model's entry), "next_h_pre" [T, n] (this sublayer's projection's, for the next sublayer),
"h_post" [T, n], "h_res" [T, n, n]}` the peer exposes. A peer with `single_pass`, `mix` and `aggregate` but no
`single_pass_stack` of its own is chained by the suite for the single-pass stack checks (`aggregate` is the exit).

`stack` is the peer's own composition of several layers, as its model runs them: one stream in,
expanded to n copies, every layer on the n streams, the block exit out. A peer whose exit is the mean
of the streams ignores `head` (its gradients are then zero, as the mean-exit oracle's are). A peer
without a `stack` of its own but with `layer` is chained by the suite (expand, its `layer` per layer,
its `block_exit` or the mean), and its report says so.

Timing (the perf suite, `suites/perf/test_peers.py`): a peer with a `timing` times its own natural entry
points, the calls a user makes over all tokens at once, through `timed(op, n=, hidden=, dtype=,
iterations=)`, which returns `fn(inputs) -> outputs` in the reference's output order. `inputs` (seeded
by the suite): `x [T, n, C]` in the activation dtype; per sublayer `k` (0, and 1 for `layer_mhc`) fp32
`w{k} [N, n*C]`, `a{k} [3]` (alpha_pre, alpha_post, alpha_res) and `b{k} [N]`; for `sinkhorn` fp32
`logits [T, n, n]`.

| timed op | what is timed | returns |
|---|---|---|
| `coefficients` | H_pre / H_post / H_res and the aggregate from the streams | `(h_post [T, n], h_res [T, n, n], aggregate [T, C])` |
| `layer_mhc` | the mHC part of one decoder layer, both sublayers the identity | `(x [T, n, C],)` |
| `sinkhorn` | Sinkhorn of `logits` | `(h_res [T, n, n],)` |
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from harness.peers.installed import InstalledFiles
    from harness.upstream.source_tree import SourceTree

__all__ = [
    "FromInstalledFiles",
    "FromSourceTree",
    "Replayed",
    "OPS",
    "TIMED_OPS",
    "Head",
    "Peer",
    "PeerError",
    "Sublayer",
    "SublayerParams",
    "TimedFn",
    "Timing",
    "bind_tensors",
    "has_own",
    "timed_params",
]

OPS = (
    "coefficients",
    "aggregate",
    "mix",
    "sinkhorn",
    "layer",
    "block_exit",
    "stack",
    "single_pass",
    "single_pass_stack",
)
TIMED_OPS = ("coefficients", "layer_mhc", "sinkhorn")

TimedFn = Callable[[Mapping[str, torch.Tensor]], tuple[torch.Tensor, ...]]
"""A peer's timed entry point: `fn(inputs) -> outputs` (the module docstring's table)."""


class PeerError(RuntimeError):
    """A peer raised on an input; the message names the peer, the op and the input shapes."""


@dataclass(frozen=True, kw_only=True)
class SublayerParams:
    """The reference's parameters of one mHC sublayer (`HyperConnectionModule`).

    `weight` is `mapping_proj.weight` `[N, n*C]` (N = n*n + 2n), `bias` `[N]` laid out
    `[pre(n) | post(n) | res(n*n row-major)]`, the alphas `[1]`.
    """

    n: int
    weight: torch.Tensor
    alpha_pre: torch.Tensor
    alpha_post: torch.Tensor
    alpha_res: torch.Tensor
    bias: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """`{name: tensor}` in the reference's state-dict names."""
        return {
            "mapping_proj.weight": self.weight,
            "alpha_pre": self.alpha_pre,
            "alpha_post": self.alpha_post,
            "alpha_res": self.alpha_res,
            "bias": self.bias,
        }

    def alphas(self) -> torch.Tensor:
        """`[alpha_pre, alpha_post, alpha_res]` `[3]`: DeepSeek-V4's `scale` (and its ports')."""
        return torch.cat([self.alpha_pre, self.alpha_post, self.alpha_res])

    def detached(self, dtype: torch.dtype) -> SublayerParams:
        """Leaf copies in `dtype` that require grad (the checks differentiate with respect to them)."""
        new = {
            k: v.detach().to(dtype).clone().requires_grad_(True)
            for k, v in (
                ("weight", self.weight),
                ("alpha_pre", self.alpha_pre),
                ("alpha_post", self.alpha_post),
                ("alpha_res", self.alpha_res),
                ("bias", self.bias),
            )
        }
        return SublayerParams(n=self.n, **new)


@dataclass(frozen=True, kw_only=True)
class Sublayer:
    """One sublayer of a `layer` check: its mHC parameters and the function it wraps, `f [T, C] -> [T, C]`."""

    params: SublayerParams
    f: Callable[[torch.Tensor], torch.Tensor]
    w: torch.Tensor | None = None
    """The stand-in's weight where `f` is the checks' `tanh(y @ w)` `[C, C]`: a peer in another framework (JAX)
    runs that function itself."""


@dataclass(frozen=True, kw_only=True)
class Head:
    """The learned block exit's parameters: `fn [n, n*C]`, `base [n]`, `scale [1]` (`hc_head_*`)."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How the perf suite times a peer beside ours."""

    variant: str
    """The configuration ours runs beside it (the one it conforms to, e.g. `megatron_dev`)."""
    ops: frozenset[str]
    """Its timed ops, of `TIMED_OPS`."""
    gpu_only: bool = False
    """Timed on an NVIDIA GPU only (a CPU cannot run it, or runs it under an interpreter whose times mean nothing)."""
    compiled: bool = False
    """Also timed under `torch.compile`, as `<name>[compiled]`."""

    def __post_init__(self) -> None:
        unknown = sorted(self.ops - set(TIMED_OPS))
        if unknown or not self.ops:
            raise ValueError(
                f"Timing.ops {sorted(self.ops)}: {unknown or 'none'} not among {list(TIMED_OPS)}"
            )


def timed_params(
    inputs: Mapping[str, torch.Tensor], k: int, dtype: torch.dtype | None = None
) -> SublayerParams:
    """Sublayer `k`'s parameters from timing inputs (`w{k}`, `a{k}`, `b{k}`), cast to `dtype` if given (a
    differentiable cast: gradients reach the inputs)."""
    w, a, b = (inputs[f"{name}{k}"] if dtype is None else inputs[f"{name}{k}"].to(dtype) for name in "wab")
    return SublayerParams(
        n=inputs["x"].shape[1], weight=w, alpha_pre=a[0:1], alpha_post=a[1:2], alpha_res=a[2:3], bias=b
    )


@dataclass(frozen=True, kw_only=True)
class Peer(ABC):
    """An mHC implementation under test. Subclasses set the fields and implement the ops in `ops`."""

    name: str
    """Stable id, e.g. `hf_deepseek_v4` or `mhc_core[megatron_dev]`."""
    description: str
    ops: frozenset[str]
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32)
    """The dtypes its checks run in (the peer's compute dtype: a peer that upcasts to fp32 lists fp32 only)."""
    streams: tuple[int, ...] = (2, 4)
    """The n it supports, among those the suite checks."""
    differences: Mapping[str, str] = field(default_factory=dict)
    """What differs from the reference, by op (its norm, its projection, ...): an op named here but not in
    `ops` is reported not comparable with this reason; one in `ops` gets it beside a failing check."""
    claims: str | None = None
    """The variant it says it implements (None: let the matrix tell)."""
    differentiable: bool = True
    """False for inference kernels without a backward (vLLM, sglang): its ops run under `torch.no_grad` and
    only their outputs are compared."""
    timing: Timing | None = None
    """How the perf suite times it (None: not timed); `timed` builds the calls."""

    def version(self) -> str | None:
        """The peer's version (package version, commit), or None."""
        return None

    def unavailable(self) -> str | None:
        """None when the peer can run here, else why not (a missing package or GPU): a skip reason."""
        return None

    def running(self) -> AbstractContextManager[object]:
        """The context a check's ops and their backward run in (default: none; TransformerEngine's interpreted
        kernels need a stand-in driver there)."""
        return nullcontext()

    def coefficients(
        self, x: torch.Tensor, params: SublayerParams, iterations: int
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def aggregate(self, x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mix(
        self, h_res: torch.Tensor, residual: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def sinkhorn(self, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        raise NotImplementedError

    def layer(self, x: torch.Tensor, attn: Sublayer, mlp: Sublayer, iterations: int) -> torch.Tensor:
        raise NotImplementedError

    def block_exit(
        self, x: torch.Tensor, head_fn: torch.Tensor, head_base: torch.Tensor, head_scale: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def stack(
        self, h: torch.Tensor, layers: Sequence[tuple[Sublayer, Sublayer]], head: Head, iterations: int
    ) -> torch.Tensor:
        raise NotImplementedError

    def single_pass(
        self, x: torch.Tensor, previous_h_pre: torch.Tensor | None, params: SublayerParams, iterations: int
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def single_pass_stack(
        self, h: torch.Tensor, layers: Sequence[tuple[Sublayer, Sublayer]], iterations: int
    ) -> torch.Tensor:
        raise NotImplementedError

    def timed(self, op: str, *, n: int, hidden: int, dtype: torch.dtype, iterations: int) -> TimedFn:
        """The timed entry point of `op` (of `timing.ops`) at `n` streams, width `hidden`, activation `dtype`
        (the module docstring's table); built once, called per timed repetition."""
        raise NotImplementedError(f"{self.name} has no timed entry points")

    def timed_coefficients(self, iterations: int) -> TimedFn:
        """The peer's own `coefficients` op as the timed `coefficients` call (for a peer whose op already runs
        its entry point over all tokens): `inputs -> (h_post, h_res, aggregate)`."""

        def coefficients(d: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            out = self.coefficients(d["x"], timed_params(d, 0), iterations)
            return out["h_post"], out["h_res"], out["aggregate"]

        return coefficients


@runtime_checkable
class FromInstalledFiles(Protocol):
    """A peer that runs an installed distribution's own files (the serving engines, MaxText): a recording of it
    names the package's version and the files' hashes."""

    def files(self) -> InstalledFiles: ...


@runtime_checkable
class FromSourceTree(Protocol):
    """A peer that runs from a source tree (TransformerEngine, torchtitan): a recording of it names the tree's
    commit and the files' hashes."""

    tree: Path | None

    def source_tree(self) -> SourceTree: ...


@runtime_checkable
class Replayed(Protocol):
    """A peer whose checks are recordings (`harness.conformance.replay`): `side(spec)` gives the recorded outputs
    and gradients of a check instead of running anything."""

    stack_chained: bool
    """Its recorded `stack` checks chained its `layer` (it has no stack of its own)."""

    def side(self, spec: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...


def bind_tensors(module: Any, **tensors: torch.Tensor) -> Any:
    """`module` (an `nn.Module` of the peer) with each named parameter replaced by the given tensor, a plain
    attribute instead of a `Parameter`, so that the checks' gradients reach their own leaves; returns it."""
    for name, tensor in tensors.items():
        delattr(module, name)
        setattr(module, name, tensor)
    return module


def has_own(peer: Peer, op: str) -> bool:
    """Whether `peer`'s class implements `op` itself (not `Peer`'s `NotImplementedError`)."""
    return getattr(type(peer), op) is not getattr(Peer, op)
