"""Step level: forward+backward of one transformer layer with mHC vs the same layer without.

The layer is plain torch (pre-norm causal attention + GELU MLP), so the overhead is measured
without megatron-core. The paper reports 6.7 % for a full training step at n = 4 (large model,
fused kernels, recompute); this is one layer at a small CPU size, so expect a larger number.

The floor next to it: the extra bytes mHC moves per layer (`mhc_core.analysis.layer_extra_bytes`)
timed as a plain copy in the same run, over the plain layer's time, i.e. the overhead that ideal,
bandwidth-bound mHC kernels would add (`floor_overhead_ratio`).

On a GPU also the overhead in GPU busy time (`device_overhead_ratio`: the union of the step's
kernel intervals, mHC layer over plain layer, `tools.device_time`): what the overhead would be
if launches cost nothing. Far below the measured overhead, the step waits on the host.

Memory, measured in the same test: the activation bytes autograd saves for backward in one
forward (`suites/perf/memory.py`, exact on any device) for both layers and their ratio, and on
CUDA the allocator's peak over one forward+backward. The mHC layer carries an `n*C`-wide residual,
so its saved activations grow with n; upstream answers that with mHC recompute, measured here as
`reference+recompute` and (GPU) `cutile+recompute`, the layer being one `mhc_core.recompute`
group: its time overhead on any device, its memory as the CUDA peak (the saved-bytes probe cannot
see inside the group's hooks).

DeepSeek-V4.1's single-pass form (`reference+single_pass`, `compiled+single_pass`): the same layer with each
connection in V4.1's numerics aggregating with the H_pre its predecessor returned (the layer's first, the one a
previous layer would hand on, is an input of the step), so its pre-op is the single-pass one (one read of the
streams where fused). In the smoke run every row iterates Sinkhorn 4 times instead of the default 20 (the compiled
graphs unroll them; the smoke figures are no measurement).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mhc_core import HyperConnectionConfig, HyperConnectionModule
from mhc_core.analysis import layer_extra_bytes
from mhc_core.kernels import dispatch
from mhc_core.recompute import StreamRecompute
from suites.perf.memory import peak_bytes, saved_activation_bytes
from suites.perf.peers import smoke
from suites.perf.timing import copy_seconds, paired_samples, synced
from tools.cutile.gpu_cases import LAYER_SIZES
from tools.device_time import device_busy_seconds

pytestmark = pytest.mark.perf
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One timed layer: `[seq, batch, hidden]` activations, `heads` attention heads, `n` streams."""

    seq: int
    batch: int
    hidden: int
    heads: int
    n: int = 4

    @property
    def id(self) -> str:
        return f"s{self.seq}-b{self.batch}-C{self.hidden}-n{self.n}"


GPU_SHAPES = tuple(LayerShape(seq=s, batch=b, hidden=c, heads=h) for s, b, c, h in LAYER_SIZES)
"""On a GPU, the paper's and Megatron's hidden sizes (`tools.cutile.gpu_cases`: `ci/precompile_cutile.py` compiles
their kernels ahead of time)."""
CPU_SHAPE = LayerShape(seq=256, batch=2, hidden=1024, heads=8)
"""The largest CPU layer the 2-core box times in seconds: hidden 1024, 512 tokens."""
SMOKE_CPU_SHAPE = LayerShape(seq=128, batch=2, hidden=512, heads=8)
"""CI's smoke run (`MHC_PERF_SMOKE=1`): a quarter of the work, the same code paths (measure with `tox -e perf`)."""
SHAPES = GPU_SHAPES if DEVICE == "cuda" else ((SMOKE_CPU_SHAPE,) if smoke() else (CPU_SHAPE,))
ITERATIONS = 4 if smoke() and DEVICE == "cpu" else 20
"""Sinkhorn iterations of the mHC layers (upstream's default, 20; 4 in CI's smoke run)."""
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


class Layer(nn.Module):
    """Pre-norm attention + MLP on [s, b, C]; with `n`, an mHC connection around each sublayer ([s, b, n*C]);
    with `peer="hf_deepseek_v4"`, the same sublayers inside transformers' `DeepseekV4DecoderLayer.forward`
    (its `attn_hc` / `ffn_hc` and mixing; its own layout, `[b, s, n, C]`)."""

    def __init__(
        self,
        shape: LayerShape,
        n: int | None,
        use_fused: bool = False,
        recompute: bool = False,
        peer: str | None = None,
        single_pass: bool = False,
    ):
        super().__init__()
        self.shape, self.recompute, self.peer, self.single_pass = shape, recompute, peer, single_pass
        c = shape.hidden
        self.norm1, self.norm2 = nn.RMSNorm(c), nn.RMSNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.n = n
        if n and peer is None:
            form = {"form": "single_pass", "variant": "deepseek_v41"} if single_pass else {}
            cfg = HyperConnectionConfig(
                hidden_size=c,
                num_residual_streams=n,
                use_fused=use_fused,
                sinkhorn_iterations=ITERATIONS,
                **form,
            )
            self.hc_attn, self.hc_mlp = HyperConnectionModule(cfg), HyperConnectionModule(cfg)
        if peer == "hf_deepseek_v4":
            from harness.peers.hf_deepseek_v4 import _decoder_layer, _hc

            hcs = [_hc(n, c, ITERATIONS, torch.float32) for _ in (0, 1)]
            for hc in hcs:  # transformers leaves them uninitialised (torch.empty): the reference's init
                nn.init.xavier_uniform_(hc.fn)
                nn.init.zeros_(hc.base)
                nn.init.constant_(hc.scale, 0.01)
            self.hf = _decoder_layer(hcs[0], self._attention_bsc, hcs[1], self.mlp)
        elif peer is not None:
            raise ValueError(f"Layer(peer={peer!r}): the only layer peer is 'hf_deepseek_v4'")

    def _attention_bsc(self, x: torch.Tensor) -> torch.Tensor:
        """`attention` on DeepSeek-V4's `[b, s, C]` (the adapter flattens it to `[b*s, C]`)."""
        return (
            self.attention(x.view(self.shape.batch, self.shape.seq, -1).transpose(0, 1))
            .transpose(0, 1)
            .reshape(x.shape)
        )

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s, b, c = x.shape
        heads = self.shape.heads
        q, k, v = self.qkv(self.norm1(x)).view(s, b, 3, heads, c // heads).permute(2, 1, 3, 0, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.permute(2, 0, 1, 3).reshape(s, b, c))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm2(x))))

    def forward(self, x: torch.Tensor, h_pre: torch.Tensor | None = None) -> torch.Tensor:
        """`x [s, b, n*C]` (`[s, b, C]` plain); `h_pre [s, b, n]`: single-pass only, the H_pre a previous layer
        hands on."""
        if self.single_pass:
            for hc, sub in ((self.hc_attn, self.attention), (self.hc_mlp, self.mlp)):
                branch, h_res, h_post, h_pre = hc(x, previous_h_pre=h_pre)
                x = hc.post_residual_bda(h_res, x, h_post, (sub(branch), None))
            return x
        if self.peer:
            return self.hf(x.view(self.shape.batch, self.shape.seq, self.n, self.shape.hidden)).view(x.shape)
        if not self.n:
            x = x + self.attention(x)
            return x + self.mlp(x)
        if self.recompute and torch.is_grad_enabled():
            group = StreamRecompute(x)  # the layer is one mHC recompute group: its middle state is rebuilt
            with group.saving():
                for hc, sub in ((self.hc_attn, self.attention), (self.hc_mlp, self.mlp)):
                    agg, h_res, h_post, residual = hc(x)
                    x = group.post_residual_bda(hc, h_res, residual, h_post, (sub(agg), None))
            group.close()
            return x
        for hc, sub in ((self.hc_attn, self.attention), (self.hc_mlp, self.mlp)):
            agg, h_res, h_post, residual = hc(x)
            x = hc.post_residual_bda(h_res, residual, h_post, (sub(agg), None))
        return x


def _step(layer: Layer, width: int):
    sh = layer.shape
    shape = (sh.batch, sh.seq, width) if layer.peer else (sh.seq, sh.batch, width)
    x = torch.randn(*shape, device=DEVICE, dtype=DTYPE, requires_grad=True)
    g = torch.randn_like(x)
    h_pre = None
    if layer.single_pass:  # the previous layer's last H_pre (fp32 under V4.1's coefficients)
        n = layer.n or 1
        h_pre = (0.5 + 0.1 * torch.randn(sh.seq, sh.batch, n, device=DEVICE)).requires_grad_()

    def run():
        layer.zero_grad(set_to_none=True)
        torch.autograd.backward(layer(x, h_pre), g)

    run.forward = lambda: layer(x, h_pre)  # type: ignore[attr-defined]  # the forward alone, for the forward rows
    return run


def _memory(layer: Layer, run) -> dict[str, int | None]:
    """Saved activation bytes of one forward (params excluded; None under mHC recompute, whose own
    saved-tensor hooks hide the saves from the probe) and, on CUDA, the fwd+bwd peak."""
    saved = None if layer.recompute else saved_activation_bytes(run.forward, layer.parameters())
    return {"saved": saved, "peak": peak_bytes(run, DEVICE)}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        "compiled",
        "cutile",
        "reference+recompute",
        "cutile+recompute",
        "hf_deepseek_v4",
        "reference+single_pass",
        "compiled+single_pass",
    ],
)
def test_layer_overhead(benchmark, backend, shape, reps, monkeypatch):
    """mHC layer fwd+bwd time and its overhead over the plain layer, both measured in this run; the
    `hf_deepseek_v4` row is the same layer with DeepSeek-V4's mHC (transformers' code) instead of ours, the
    `+single_pass` rows DeepSeek-V4.1's single-pass form."""
    recompute = backend.endswith("+recompute")
    single_pass = backend.endswith("+single_pass")
    ops_backend = backend.removesuffix("+recompute").removesuffix("+single_pass")
    fused = ops_backend in ("compiled", "cutile")
    peer = backend if backend == "hf_deepseek_v4" else None
    if peer:
        pytest.importorskip(
            "transformers.models.deepseek_v4", reason="transformers (the peers extra) is not installed"
        )
    if fused:
        ok, why = dispatch.availability(ops_backend, DEVICE)
        if not ok:
            pytest.skip(f"backend {ops_backend} unavailable: {why}")
        monkeypatch.setenv("MHC_BACKEND", ops_backend)  # use_fused=True would pick cutile on a GPU
    torch.manual_seed(0)
    plain = Layer(shape, None).to(DEVICE, DTYPE)
    mhc = Layer(shape, shape.n, use_fused=fused, recompute=recompute, peer=peer, single_pass=single_pass).to(
        DEVICE, DTYPE
    )
    run, plain_run = _step(mhc, shape.n * shape.hidden), _step(plain, shape.hidden)
    mhc_t, plain_t = paired_samples([run, plain_run], device=DEVICE, reps=reps, warmup=3)
    mem, plain_mem = _memory(mhc, run), _memory(plain, plain_run)
    mhc_s, plain_s = statistics.median(mhc_t), statistics.median(plain_t)
    extra = layer_extra_bytes(
        tokens=shape.seq * shape.batch,
        n=shape.n,
        hidden=shape.hidden,
        act_bytes=torch.empty((), dtype=DTYPE).element_size(),
    )
    floor_s = copy_seconds(extra, device=DEVICE, reps=reps)
    benchmark.group = "layer-fwdbwd"
    benchmark.pedantic(synced(run, device=DEVICE), rounds=max(3, reps // 2), warmup_rounds=1, iterations=1)
    benchmark.extra_info.update(
        {
            "op": "layer",
            "direction": "fwdbwd",
            "backend": backend,
            "device": DEVICE,
            **({"mhc_of": peer} if peer else {}),
            "shape": shape.id,
            "median_s": mhc_s,
            "plain_median_s": plain_s,
            "overhead_ratio": mhc_s / plain_s - 1.0,
            "plain_saved_bytes": plain_mem["saved"],
            "extra_bytes": extra,
            "floor_overhead_ratio": floor_s / plain_s,
        }
    )
    if mem["saved"] is not None:
        benchmark.extra_info.update(
            {"saved_bytes": mem["saved"], "saved_bytes_ratio": mem["saved"] / plain_mem["saved"]}
        )
    busy, plain_busy = device_busy_seconds(run, DEVICE), device_busy_seconds(plain_run, DEVICE)
    if busy is not None:
        # The overhead if launches cost nothing (GPU busy time, `tools.device_time`), next to the
        # measured one: far apart, the mHC layer is host-bound at this size.
        benchmark.extra_info.update(
            {
                "device_busy_s": busy,
                "plain_device_busy_s": plain_busy,
                "device_overhead_ratio": busy / plain_busy - 1.0,
            }
        )
    if mem["peak"] is not None:
        benchmark.extra_info.update(
            {
                "peak_bytes": mem["peak"],
                "plain_peak_bytes": plain_mem["peak"],
                "peak_bytes_ratio": mem["peak"] / plain_mem["peak"],
            }
        )
    assert mhc_s > 0 and plain_s > 0 and floor_s > 0
    # The mHC layer saves at least what the plain one does (same sublayers) plus its n*C residual.
    assert plain_mem["saved"] > 0 and (mem["saved"] is None or mem["saved"] > plain_mem["saved"]), (
        mem,
        plain_mem,
    )
