"""The single-pass pre-op (DeepSeek-V4.1) timed against V4's pre, our reference and vLLM's torch path, in one run.

Per dtype and direction, rep by rep in alternation (`paired_samples`, so every ratio is taken under the same load):

- `ours`: `single_pass_pre` on the compiled backend (on CPU the native kernel's one read of the streams);
- `reference`: the same op on the reference backend (mapping, Sinkhorn and aggregate, eager);
- `v4_pre`: our compiled per-sublayer `pre` in the same numerics (DeepSeek-V4.1's), the op single-pass replaces;
- `vllm`: vLLM 0.33.0's `mhc_pre_delayed_torch` (`vllm/model_executor/kernels/mhc/torch.py`, its eager V4.1
  pre with the previous sublayer's `pre_mix`), forward, and forward + backward under autograd (vLLM serves it
  forward only: the backward is what training on its torch path would cost). Timed only where its outputs
  match our reference's at the case's size (the failure names the worst output);
- a copy of the same bytes (`mhc_core.analysis.bytes_moved("single_pass_pre")`).

`extra_info` holds the seconds of each, `roofline_ratio` (copy / ours), `speedup_vs_reference`,
`speedup_vs_v4_pre` and `speedup_vs_vllm`. Nothing here asserts a speed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from harness.peers.sglang import EPS
from harness.peers.vllm import TORCH_FILE, VLLM, load_vllm_file
from mhc_core.analysis import bytes_moved
from mhc_core.kernels import dispatch
from mhc_core.testing import tolerance
from suites.perf.peers import smoke
from suites.perf.timing import copy_fn, paired_samples
from tools.perf_cases import ITERATIONS

pytestmark = pytest.mark.perf
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V41 = "deepseek_v41"
SMOKE_TOKENS, SMOKE_ITERATIONS = 256, 4
"""CI's smoke run (`MHC_PERF_SMOKE=1`): every timed path runs over few tokens at 4 unrolled Sinkhorn iterations, in
fp32; its figures are no measurement."""


@dataclass(frozen=True, kw_only=True)
class SinglePassCase:
    """One size: T tokens of n streams of width C."""

    tokens: int
    hidden: int
    dtype: torch.dtype
    n: int = 4
    iterations: int = ITERATIONS

    @property
    def id(self) -> str:
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        it = "" if self.iterations == ITERATIONS else f"-it{self.iterations}"
        return f"single_pass_pre-T{self.tokens}-n{self.n}-C{self.hidden}-{name}{it}"

    def bytes(self, direction: str) -> int:
        act = torch.empty((), dtype=self.dtype).element_size()
        size = dict(tokens=self.tokens, n=self.n, hidden=self.hidden, act_bytes=act)
        fwd = bytes_moved("single_pass_pre", "fwd", **size).total
        return fwd if direction == "fwd" else fwd + bytes_moved("single_pass_pre", "bwd", **size).total

    def inputs(self, requires_grad: bool) -> dict[str, torch.Tensor]:
        """Seeded: streams `x [T, n*C]` in the case dtype, the previous H_pre `[T, n]` fp32 (V4.1's coefficients
        are fp32), fp32 parameters."""
        g = torch.Generator().manual_seed(0)
        t, n, c = self.tokens, self.n, self.hidden
        big = n * n + 2 * n

        def rnd(*shape, dtype=torch.float32, scale=1.0, shift=0.0):
            v = (shift + torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)
            return v.requires_grad_(requires_grad)

        return {
            "x": rnd(t, n * c, dtype=self.dtype),
            "previous_h_pre": rnd(t, n, scale=0.1, shift=0.5),
            "weight": rnd(big, n * c, scale=0.02),
            "alpha_pre": rnd(1, scale=0.01, shift=0.5),
            "alpha_post": rnd(1, scale=0.01, shift=0.5),
            "alpha_res": rnd(1, scale=0.01, shift=0.5),
            "bias": rnd(big, scale=0.01),
        }


def _cases() -> list[SinglePassCase]:
    if DEVICE == "cuda":
        return [SinglePassCase(tokens=8192, hidden=4096, dtype=torch.bfloat16)]
    if smoke():  # fp32 only: each dtype's graphs are a compile of their own
        return [
            SinglePassCase(tokens=SMOKE_TOKENS, hidden=256, dtype=torch.float32, iterations=SMOKE_ITERATIONS)
        ]
    # The pre-op's perf sizes (`tools.perf_cases`): 64 MiB of streams, out of any CPU cache.
    return [
        SinglePassCase(tokens=4096, hidden=1024, dtype=torch.float32),
        SinglePassCase(tokens=4096, hidden=2048, dtype=torch.bfloat16),
    ]


def _vllm_call(case: SinglePassCase, t: dict[str, torch.Tensor]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """vLLM's eager V4.1 pre on the case's inputs, returning ours's order: `(layer_input, next_pre, post, comb)`."""
    fn = load_vllm_file(VLLM.path(TORCH_FILE), "torch").mhc_pre_delayed_torch
    scale = torch.cat([t["alpha_pre"], t["alpha_post"], t["alpha_res"]])
    tokens, n = case.tokens, case.n

    def call():
        post, comb, layer_input, pre = fn(
            t["x"].view(tokens, n, case.hidden),
            t["weight"],
            scale,
            t["bias"],
            EPS,
            EPS,
            EPS,
            2.0,
            case.iterations,
            pre_mix=t["previous_h_pre"],
        )
        return layer_input, pre, post.reshape(tokens, n), comb

    return call


def _ours(backend: str, case: SinglePassCase, t: dict[str, torch.Tensor], single: bool = True):
    args = (
        t["weight"],
        t["alpha_pre"],
        t["alpha_post"],
        t["alpha_res"],
        t["bias"],
        case.n,
        case.iterations,
        V41,
    )
    if single:
        op = dispatch.op_on("single_pass_pre", backend)
        return lambda: op(t["x"], t["previous_h_pre"], *args)
    op = dispatch.op_on("pre", backend)
    return lambda: op(t["x"], *args)


def _vllm_gap(case: SinglePassCase) -> str | None:
    """Why vLLM's row is not timed at `case`, or None: not installed, or not matching our reference there."""
    why = VLLM.unavailable()
    if why:
        return why
    t = case.inputs(requires_grad=False)
    with torch.no_grad():
        got = _vllm_call(case, t)()
        want = _ours("reference", case, t)()
    tol = tolerance(case.dtype, "fwd")
    for name, a, e in zip(("layer_input", "next_h_pre", "h_post", "h_res"), got, want, strict=True):
        err = float((a.double() - e.double()).abs().max())
        if err > tol.atol + tol.rtol * float(e.double().abs().max()):
            return f"vLLM's {name} is {err:.3g} off ours at {case.id} (bound {tol}): not timed"
    return None


def _timed(fn: Callable[[], tuple[torch.Tensor, ...]], direction: str, leaves: list[torch.Tensor]):
    if direction == "fwd":

        def fwd():
            with torch.no_grad():
                return fn()

        return fwd
    outs = fn()
    cot = [torch.randn_like(o) for o in outs]

    def fwdbwd():
        o = fn()
        return torch.autograd.grad(o, leaves, cot, allow_unused=True)

    return fwdbwd


@pytest.mark.parametrize("direction", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_single_pass_pre(benchmark, case, direction, reps):
    """Time the fused single-pass pre beside the reference, V4's pre, vLLM's torch path and a same-bytes copy."""
    ok, why = dispatch.availability("compiled", DEVICE)
    if not ok:
        pytest.skip(f"our compiled backend is unavailable here: {why}")
    t = case.inputs(requires_grad=direction == "fwdbwd")
    leaves = [t["x"], t["previous_h_pre"], t["weight"], t["bias"]]
    nbytes = case.bytes(direction)
    names = ["ours", "copy", "reference", "v4_pre"]
    fns = [
        _timed(_ours("compiled", case, t), direction, leaves),
        copy_fn(nbytes, device=DEVICE),
        _timed(_ours("reference", case, t), direction, leaves),
        _timed(_ours("compiled", case, t, single=False), direction, [t["x"], t["weight"], t["bias"]]),
    ]
    vllm_gap = _vllm_gap(case)
    if vllm_gap is None:
        names.append("vllm")
        fns.append(_timed(_vllm_call(case, t), direction, leaves))
    samples = paired_samples(fns, device=DEVICE, reps=reps, warmup=2)
    med = {name: statistics.median(s) for name, s in zip(names, samples, strict=True)}
    benchmark.group = f"single_pass_pre-{direction}"
    result = benchmark.pedantic(fns[0], rounds=max(3, reps // 2), warmup_rounds=1, iterations=1)
    info: dict[str, object] = {
        "op": "single_pass_pre",
        "direction": direction,
        "backend": "compiled",
        "shape": case.id,
        "device": DEVICE,
        "bytes": nbytes,
        **{f"{name}_s": s for name, s in med.items()},
        "roofline_ratio": med["copy"] / med["ours"],
        "speedup_vs_reference": med["reference"] / med["ours"],
        "speedup_vs_v4_pre": med["v4_pre"] / med["ours"],
    }
    if "vllm" in med:
        info["speedup_vs_vllm"] = med["vllm"] / med["ours"]
    else:
        info["vllm_not_timed"] = vllm_gap
    benchmark.extra_info.update(info)
    assert all(v > 0 for v in med.values())
    tensors = result if isinstance(result, tuple) else (result,)
    assert all(bool(torch.isfinite(v.float()).all()) for v in tensors if isinstance(v, torch.Tensor))
