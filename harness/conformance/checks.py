"""The conformance checks: the same list for every peer, each compared with every variant's oracle.

A check runs one op of a peer on a seeded case (`harness.conformance.cases`) rounded to the dtype
under test, then backpropagates seeded cotangents through what it returned, and compares outputs and
gradients with the fp64 oracle of each variant (`harness.conformance.oracle`) fed the same
rounded inputs. Bounds are `mhc_core.testing.tolerance(dtype, "fwd" | "bwd")`. A gradient the peer
does not produce (a detached input) counts as zero.

| check id | what |
|---|---|
| `coefficients` | H_pre, H_post, H_res (after Sinkhorn), the aggregate; gradients w.r.t. x and every parameter; `@rms1e-2`: the same with x scaled to RMS 1e-2 (the norm's eps) |
| `aggregate` | `sum_i h_pre_i x_i` for given h_pre; gradients w.r.t. x and h_pre |
| `mix` | residual mix plus gated output for given H_res (not symmetric), h_post, y |
| `orientation` | n = 4 only: whether the mix is `H @ x` or `H^T @ x` |
| `sinkhorn s<S> it<I>` | Sinkhorn of standard-normal logits times S (0.1, 1, 10), I (1, 20) iterations, and its gradient |
| `exact-sums` | which sums a 3-iteration Sinkhorn at scale 3 leaves exact: rows, cols or none |
| `layer` | two sublayers end to end (`x -> mix(x, f(aggregate(x)))`, attention then MLP) and the gradients w.r.t. x and both sublayers' parameters |
| `block-exit` | the learned contraction (`megatron_dev` / DeepSeek-V4 `hc_head`); no variant |
| `stack` | the peer's own composition of `STACK_LAYERS` layers: one stream expanded, the layers, the exit; outputs and the gradients w.r.t. the input and every parameter |
| `single-pass` | one single-pass (DeepSeek-V4.1) sublayer: the aggregate with the previous sublayer's H_pre, this sublayer's next H_pre, H_post and H_res; gradients w.r.t. x, the previous H_pre and every parameter; `@entry`: the model's first sublayer (no previous H_pre: stream 0); `@rms1e-2`: x at RMS 1e-2 (the norm's eps) |
| `single-pass-stack` | the single-pass structure across `STACK_LAYERS` layers: one stream expanded, every sublayer aggregating with the H_pre its predecessor returned (the first with stream 0), the exit aggregating with the last; the peer's own composition (`single_pass_stack`) or its `single_pass`, `mix` and `aggregate` chained by the suite; output and every gradient |
| `single-pass-stack-grads` | the same run: the gradient size of every mHC parameter part against the reference's (a handoff cut with a `detach` leaves the `pre` rows without one) |
| `stack-grads` | the same run: the size (norm) of the gradient each mHC parameter receives, per part (`pre`, `post`, `res` rows of the projection and the bias, each alpha), against the reference's: within `GRAD_SIZE_FACTOR` either way |

Each runs for n in the peer's `streams` among (2, 4) and each dtype of its `dtypes` (orientation,
exact-sums and the two stack checks at n = 4 only). The stack checks, like `block-exit`, depend on the
exit and are compared with configurations only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from harness.conformance.cases import Case, make_case, stack_layers, sublayers
from harness.peers.base import Head, Peer, Replayed, Sublayer, SublayerParams, has_own
from mhc_core.testing import tolerance
from mhc_core.variants import get_variant

__all__ = [
    "CHECK_STREAMS",
    "SINGLE_PASS_CHAIN_OPS",
    "EXIT_OPS",
    "GRAD_SIZE_FACTOR",
    "SINKHORN_ITERATIONS",
    "STACK_ITERATIONS",
    "CheckSpec",
    "Comparison",
    "GRAD_FLOOR",
    "GradSize",
    "chained_single_pass_stack",
    "chained_stack",
    "check_specs",
    "compare",
    "grad_sizes",
    "inputs_digest",
    "observe_exact_sums",
    "observe_orientation",
    "run_side",
    "single_pass_stack_source",
    "stack_source",
]

CHECK_STREAMS = (2, 4)
SINKHORN_ITERATIONS = 20
"""Iterations of the coefficient, mix and layer checks (upstream's default)."""
STACK_ITERATIONS = 4
"""Sinkhorn iterations of the stack checks (the Sinkhorn checks cover the iterations; here the structure)."""
GRAD_SIZE_FACTOR = 10.0
"""`stack-grads`: how far (a factor, either way) a parameter's gradient norm may be from the reference's."""
EXIT_OPS = ("block_exit", "stack")
"""The ops whose checks depend on the block exit: compared with configurations only, not the plain variants."""
_EXACT = {torch.float64: 1e-12, torch.float32: 5e-7, torch.bfloat16: 4e-3}
"""How far from 1 a sum may be and still count as exact, per dtype (megatron_dev's eps leaves 1e-6)."""

Status = Literal["pass", "fail", "n/a", "error"]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """One tensor of one check: the worst elementwise error against its bound."""

    name: str
    max_abs: float
    ratio: float
    """`max |a - e| / (atol + rtol * |e|)`: <= 1 passes; inf for a shape mismatch or a non-finite value."""
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class CheckSpec:
    """One check of the list: its id, the op it needs, n, dtype and how its inputs are made."""

    id: str
    op: str
    n: int
    dtype: torch.dtype
    case: Case
    kind: Literal["numeric", "orientation", "exact_sums", "grad_sizes"] = "numeric"
    variant_free: bool = False
    """Compared with one oracle whatever the variant (the learned block exit)."""
    scale: float = 1.0
    iterations: int = SINKHORN_ITERATIONS


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")


def check_specs(peer: Peer) -> list[CheckSpec]:
    """Every check the peer's ops, streams and dtypes allow, in a stable order."""
    out: list[CheckSpec] = []
    for dtype in peer.dtypes:
        for n in CHECK_STREAMS:
            if n in peer.streams:
                out += _specs_for(n, dtype)
    return out


def _specs_for(n: int, dtype: torch.dtype) -> list[CheckSpec]:
    case = make_case(n).cast(dtype)
    small = make_case(n, x_scale=1e-2).cast(dtype)
    tag = f"n{n} {_dtype_name(dtype)}"

    def spec(cid: str, op: str, **kw: Any) -> CheckSpec:
        return CheckSpec(id=f"{cid} {tag}", op=op, n=n, dtype=dtype, case=kw.pop("case", case), **kw)

    out = [
        spec("coefficients", "coefficients"),
        spec("coefficients@rms1e-2", "coefficients", case=small),
        spec("aggregate", "aggregate"),
        spec("mix", "mix"),
    ]
    if n >= 3:
        out.append(spec("orientation", "mix", kind="orientation"))
    out += [
        spec(f"sinkhorn s{scale:g} it{it}", "sinkhorn", scale=scale, iterations=it)
        for scale in (0.1, 1.0, 10.0)
        for it in (1, 20)
    ]
    if n >= 3:
        out.append(spec("exact-sums", "sinkhorn", kind="exact_sums", scale=3.0, iterations=3))
    out += [
        spec("single-pass", "single_pass", iterations=STACK_ITERATIONS),
        spec("single-pass@entry", "single_pass", iterations=STACK_ITERATIONS),
        spec("single-pass@rms1e-2", "single_pass", case=small, iterations=STACK_ITERATIONS),
        spec("layer", "layer"),
        spec("block-exit", "block_exit", variant_free=True),
    ]
    if (
        n >= 3
    ):  # what a stack adds (where the streams live between layers) shows at any n: the larger one only
        out += [
            spec("stack", "stack", iterations=STACK_ITERATIONS),
            spec("stack-grads", "stack", kind="grad_sizes", iterations=STACK_ITERATIONS),
            spec("single-pass-stack", "single_pass_stack", iterations=STACK_ITERATIONS),
            spec(
                "single-pass-stack-grads",
                "single_pass_stack",
                kind="grad_sizes",
                iterations=STACK_ITERATIONS,
            ),
        ]
    return out


def _leaves(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype).clone().requires_grad_(True) for k, v in tensors.items()}


def _params(d: dict[str, torch.Tensor], prefix: str, n: int) -> SublayerParams:
    return SublayerParams(
        n=n,
        weight=d[f"{prefix}weight"],
        alpha_pre=d[f"{prefix}alpha_pre"],
        alpha_post=d[f"{prefix}alpha_post"],
        alpha_res=d[f"{prefix}alpha_res"],
        bias=d[f"{prefix}bias"],
    )


def _param_inputs(p: SublayerParams, prefix: str) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}weight": p.weight,
        f"{prefix}alpha_pre": p.alpha_pre,
        f"{prefix}alpha_post": p.alpha_post,
        f"{prefix}alpha_res": p.alpha_res,
        f"{prefix}bias": p.bias,
    }


def _inputs(
    spec: CheckSpec,
) -> tuple[dict[str, torch.Tensor], Callable[[Peer, dict], dict[str, torch.Tensor]]]:
    """The differentiable inputs of a check and how to call an op with them."""
    c, it = spec.case, spec.iterations
    if spec.op == "coefficients":
        return (
            {"x": c.x, **_param_inputs(c.params, "")},
            lambda p, d: p.coefficients(d["x"], _params(d, "", c.n), it),
        )
    if spec.op == "aggregate":
        return {"x": c.x, "h_pre": c.h_pre}, lambda p, d: {"aggregate": p.aggregate(d["x"], d["h_pre"])}
    if spec.op == "single_pass":
        entry = spec.id.startswith("single-pass@entry")
        previous = {} if entry else {"previous_h_pre": c.h_pre}
        return (
            {"x": c.x, **previous, **_param_inputs(c.params, "")},
            lambda p, d: p.single_pass(d["x"], d.get("previous_h_pre"), _params(d, "", c.n), it),
        )
    if spec.op == "mix":
        return (
            {"h_res": c.h_res, "residual": c.x, "h_post": c.h_post, "y": c.y},
            lambda p, d: {"out": p.mix(d["h_res"], d["residual"], d["h_post"], d["y"])},
        )
    if spec.op == "sinkhorn":
        return {"logits": c.logits * spec.scale}, lambda p, d: {"h_res": p.sinkhorn(d["logits"], it)}
    if spec.op == "layer":
        attn, mlp = sublayers(c)

        def run(p: Peer, d: dict) -> dict[str, torch.Tensor]:
            a = Sublayer(params=_params(d, "attn.", c.n), f=attn.f, w=attn.w)
            m = Sublayer(params=_params(d, "mlp.", c.n), f=mlp.f, w=mlp.w)
            return {"out": p.layer(d["x"], a, m, it)}

        return {"x": c.x, **_param_inputs(c.params, "attn."), **_param_inputs(c.mlp_params, "mlp.")}, run
    if spec.op == "block_exit":
        return (
            {"x": c.x, "head_fn": c.head_fn, "head_base": c.head_base, "head_scale": c.head_scale},
            lambda p, d: {"out": p.block_exit(d["x"], d["head_fn"], d["head_base"], d["head_scale"])},
        )
    if spec.op == "single_pass_stack":
        fns = stack_layers(c)

        def run_single_pass_stack(p: Peer, d: dict) -> dict[str, torch.Tensor]:
            layers = [
                (
                    Sublayer(params=_params(d, f"layer{i}.attn.", c.n), f=a.f, w=a.w),
                    Sublayer(params=_params(d, f"layer{i}.mlp.", c.n), f=m.f, w=m.w),
                )
                for i, (a, m) in enumerate(fns)
            ]
            own = has_own(p, "single_pass_stack")
            go = p.single_pass_stack if own else lambda *a: chained_single_pass_stack(p, *a)
            return {"out": go(d["h"], layers, it)}

        sp_inputs = {"h": c.h0}
        for i, (a, m) in enumerate(c.stack_params):
            sp_inputs |= {**_param_inputs(a, f"layer{i}.attn."), **_param_inputs(m, f"layer{i}.mlp.")}
        return sp_inputs, run_single_pass_stack
    if spec.op == "stack":
        fns = stack_layers(c)

        def run_stack(p: Peer, d: dict) -> dict[str, torch.Tensor]:
            layers = [
                (
                    Sublayer(params=_params(d, f"layer{i}.attn.", c.n), f=a.f, w=a.w),
                    Sublayer(params=_params(d, f"layer{i}.mlp.", c.n), f=m.f, w=m.w),
                )
                for i, (a, m) in enumerate(fns)
            ]
            head = Head(fn=d["head_fn"], base=d["head_base"], scale=d["head_scale"])
            go = p.stack if has_own(p, "stack") else lambda *a: chained_stack(p, *a)
            return {"out": go(d["h"], layers, head, it)}

        stack_inputs = {"h": c.h0}
        for i, (a, m) in enumerate(c.stack_params):
            stack_inputs |= {**_param_inputs(a, f"layer{i}.attn."), **_param_inputs(m, f"layer{i}.mlp.")}
        return {
            **stack_inputs,
            "head_fn": c.head_fn,
            "head_base": c.head_base,
            "head_scale": c.head_scale,
        }, run_stack
    raise ValueError(f"check {spec.id}: unknown op {spec.op!r}")


def stack_source(peer: Peer) -> str | None:
    """How a peer's `stack` checks run: `"own"` (its `stack`), `"chained"` (its `layer` chained by the suite)
    or None (neither)."""
    if "stack" in peer.ops:
        return "chained" if isinstance(peer, Replayed) and peer.stack_chained else "own"
    return "chained" if "layer" in peer.ops and not isinstance(peer, Replayed) else None


def chained_stack(peer: Peer, h: torch.Tensor, layers, head: Head, iterations: int) -> torch.Tensor:
    """`h [T, C] -> [T, C]`: n copies of `h`, the peer's `layer` per layer, its `block_exit` (the mean of the
    streams when it has none): a peer's layers composed by the suite."""
    n = layers[0][0].params.n
    x = h.unsqueeze(1).expand(h.shape[0], n, h.shape[1]).contiguous()
    for attn, mlp in layers:
        x = peer.layer(x, attn, mlp, iterations)
    if "block_exit" in peer.ops:
        return peer.block_exit(x, head.fn, head.base, head.scale)
    return x.mean(dim=1)


SINGLE_PASS_CHAIN_OPS = frozenset({"single_pass", "mix", "aggregate"})
"""What the suite needs of a peer to chain its single-pass stack."""


def single_pass_stack_source(peer: Peer) -> str | None:
    """How a peer's single-pass stack checks run: `"own"` (its `single_pass_stack`), `"chained"` (its `single_pass`,
    `mix` and `aggregate` chained by the suite) or None (neither)."""
    if "single_pass_stack" in peer.ops:
        return "own"
    return "chained" if SINGLE_PASS_CHAIN_OPS <= peer.ops else None


def chained_single_pass_stack(peer: Peer, h: torch.Tensor, layers, iterations: int) -> torch.Tensor:
    """`h [T, C] -> [T, C]`: n copies of `h`; per sublayer the peer's `single_pass` with the H_pre the previous one
    returned (None first: stream 0), the sublayer's function of its aggregate, the peer's `mix`; its `aggregate`
    with the last H_pre as the exit."""
    n = layers[0][0].params.n
    x = h.unsqueeze(1).expand(h.shape[0], n, h.shape[1]).contiguous()
    mix = None
    for pair in layers:
        for sub in pair:
            out = peer.single_pass(x, mix, sub.params, iterations)
            x = peer.mix(out["h_res"], x, out["h_post"], sub.f(out["aggregate"]))
            mix = out["next_h_pre"]
    return peer.aggregate(x, mix)


@dataclass(frozen=True, kw_only=True)
class GradSize:
    """One mHC parameter part of a `stack-grads` check: the norms of the peer's and the reference's gradient."""

    name: str
    peer: float
    reference: float

    @property
    def ratio(self) -> float:
        return self.peer / self.reference if self.reference > 0 else (math.inf if self.peer > 0 else 1.0)


def _parts(name: str, g: torch.Tensor, n: int) -> list[tuple[str, torch.Tensor]]:
    """A stack parameter's gradient split into its `pre`, `post`, `res` parts (weight rows, bias entries)."""
    if name.endswith(".weight") or name.endswith(".bias"):
        return [(f"{name}[pre]", g[:n]), (f"{name}[post]", g[n : 2 * n]), (f"{name}[res]", g[2 * n :])]
    return [(name, g)]


GRAD_FLOOR = 1e-6
"""A parameter part whose reference gradient norm is below this fraction of the largest part's gets none by
construction (the head under a mean exit; the last sublayer's `res` part under a mean exit, which a doubly
stochastic H_res leaves unchanged): `stack-grads` leaves it out."""


def grad_sizes(
    peer_grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor], n: int
) -> list[GradSize]:
    """The gradient norm of every mHC parameter part of a stack (the input `h` left out), peer against reference,
    without the parts the reference gives no gradient (`GRAD_FLOOR`)."""
    out = []
    for key, ref in ref_grads.items():
        name = key.removeprefix("grad ")
        if name == "h":
            continue
        peer = peer_grads.get(key, torch.zeros_like(ref))
        for (part, r), (_, p) in zip(_parts(name, ref, n), _parts(name, peer, n), strict=True):
            out.append(GradSize(name=part, peer=float(p.norm()), reference=float(r.norm())))
    top = max((g.reference for g in out), default=0.0)
    return [g for g in out if g.reference > GRAD_FLOOR * top]


def inputs_digest(spec: CheckSpec) -> str:
    """sha256 of a check's rounded inputs (names, shapes, bytes): a recording made on other inputs is refused."""
    import hashlib

    h = hashlib.sha256(spec.id.encode())
    for name, t in _inputs(spec)[0].items():
        t = t.detach().to(spec.dtype).contiguous()
        h.update(f"{name}{list(t.shape)}".encode())
        h.update(t.to(torch.float64).numpy().tobytes())
    return h.hexdigest()


def _cotangents(outputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 + seed)
    return {
        k: torch.randn(tuple(v.shape), generator=g, dtype=torch.float64) for k, v in sorted(outputs.items())
    }


def run_side(
    peer: Peer, spec: CheckSpec, dtype: torch.dtype, keys: tuple[str, ...] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the check's op on `peer` with inputs in `dtype`: `(outputs, gradients)` as fp64, detached.
    `keys` restricts the outputs the cotangents go through (the peer's, when this is the oracle). A peer
    that is not `differentiable` runs without autograd and has no gradients (`{}`). Forward and backward
    run in `peer.running()`."""
    raw, call = _inputs(spec)
    leaves = _leaves(raw, spec.dtype)  # rounded once to the dtype under test ...
    if dtype != spec.dtype:
        leaves = _leaves(leaves, dtype)  # ... and then promoted for the oracle
    with peer.running():
        with torch.set_grad_enabled(peer.differentiable):
            outputs = call(peer, leaves)
        _check_outputs(peer, spec, outputs)
        if keys is not None:
            outputs = {k: outputs[k] for k in keys}
        out_values = {k: v.detach().to(torch.float64) for k, v in outputs.items()}
        if not peer.differentiable:
            return out_values, {}
        cot = _cotangents(outputs, spec.case.seed)
        loss = (
            torch.stack([(outputs[k].to(torch.float64) * cot[k]).sum() for k in cot]).sum() if cot else None
        )
        grads = (
            torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            if loss is not None and loss.requires_grad
            else [None] * len(leaves)
        )
    out_grads = {
        f"grad {k}": (
            torch.zeros_like(v, dtype=torch.float64) if gr is None else gr.detach().to(torch.float64)
        )
        for (k, v), gr in zip(leaves.items(), grads, strict=True)
    }
    return out_values, out_grads


def _check_outputs(peer: Peer, spec: CheckSpec, outputs: object) -> None:
    if not isinstance(outputs, dict) or not outputs:
        raise TypeError(f"{peer.name}.{spec.op} returned {type(outputs).__name__}, not a dict of tensors")


def _comparison(
    name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, kind: str
) -> Comparison:
    tol = tolerance(dtype, kind)
    if actual.shape != expected.shape:
        return Comparison(
            name=name,
            max_abs=math.inf,
            ratio=math.inf,
            detail=f"shape {list(actual.shape)} != expected {list(expected.shape)}",
        )
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return Comparison(name=name, max_abs=math.inf, ratio=math.inf, detail="non-finite values")
    if actual.numel() == 0:
        return Comparison(name=name, max_abs=0.0, ratio=0.0)
    err = (actual - expected).abs()
    ratio = err / (tol.atol + tol.rtol * expected.abs())
    i = int(ratio.argmax())
    idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), actual.shape))
    return Comparison(
        name=name,
        max_abs=float(err.max()),
        ratio=float(ratio.flatten()[i]),
        detail=f"at {list(idx)}: {float(actual[idx]):.9g} vs {float(expected[idx]):.9g}",
    )


def compare(
    peer_side: tuple[dict, dict], oracle_side: tuple[dict, dict], dtype: torch.dtype
) -> list[Comparison]:
    """Every output and gradient of the peer against the oracle's (missing on the oracle side: an error)."""
    out: list[Comparison] = []
    for kind, p, o in (("fwd", peer_side[0], oracle_side[0]), ("bwd", peer_side[1], oracle_side[1])):
        for name, actual in p.items():
            if name not in o:
                out.append(
                    Comparison(name=name, max_abs=math.inf, ratio=math.inf, detail="not in the oracle")
                )
                continue
            out.append(_comparison(name, actual, o[name], dtype, kind))
    return out


def observe_orientation(peer_out: torch.Tensor, spec: CheckSpec) -> tuple[str, float, float]:
    """`("H @ x" | "H^T @ x" | "neither", ratio to H @ x, ratio to H^T @ x)` of a peer's mix output."""
    from harness.conformance.oracle import oracle

    ratios = []
    for variant in ("megatron_main", "megatron_dev"):  # untransposed, transposed
        o, _ = run_side(oracle(variant), spec, torch.float64)
        ratios.append(_comparison("out", peer_out, o["out"], spec.dtype, "fwd").ratio)
    plain, transposed = ratios
    seen = "H @ x" if plain <= 1 else "H^T @ x" if transposed <= 1 else "neither"
    return seen, plain, transposed


def observe_exact_sums(h_res: torch.Tensor, dtype: torch.dtype) -> tuple[str, float, float]:
    """`(rows | cols | both | none, max |rowsum - 1|, max |colsum - 1|)` of a Sinkhorn output."""
    rows = float((h_res.sum(-1) - 1).abs().max())
    cols = float((h_res.sum(-2) - 1).abs().max())
    lim = _EXACT[dtype]
    seen = {(True, True): "both", (True, False): "rows", (False, True): "cols", (False, False): "none"}[
        (rows <= lim, cols <= lim)
    ]
    return seen, rows, cols


def expected_orientation(variant: str) -> str:
    return "H^T @ x" if get_variant(variant).res_transposed else "H @ x"


def expected_exact_sums(variant: str, dtype: torch.dtype = torch.float64) -> str:
    """The sums `variant` leaves exact, as a check in `dtype` sees them: a guard eps below the dtype's exactness
    bound (`megatron_dev`'s 1e-6 in bf16) leaves the sums normalised last looking exact; a Sinkhorn iterated in a
    half dtype (`input_dtype_sinkhorn`) leaves none."""
    spec = get_variant(variant)
    if spec.sinkhorn_in_input_dtype and dtype not in (torch.float64, torch.float32):
        return "none"  # each normalisation rounds every entry to the half dtype: no sum is left exact
    if spec.exact_sums == "none" and spec.sinkhorn_eps * 4 <= _EXACT[dtype]:
        return "cols" if spec.sinkhorn_order == "row_col" else "rows"
    return spec.exact_sums
