"""The perf cases: op x shape x dtype, each with its inputs and its bytes-moved model (`suites/perf` times
them; `ci/precompile_cutile.py` compiles the GPU ones ahead of time).

GPU: T = 8192 tokens, C in {4096, 7168}, n = 4, bf16 (the paper / Megatron sizes).
CPU: T = 4096, n = 4, C in {256, 1024} in fp32 (C = 1024 puts the n-stream tensors at 64 MiB,
far out of any CPU cache, on a 2-core CI machine), plus C = 2048 in bf16, the training dtype,
where the reference pays for its fp32 upcast: the same 64 MiB (at C = 1024 the bf16 copy of the
same bytes half fits a 32 MiB L3, and the roofline ratio swings with it). Sinkhorn always runs
in fp32: no bf16 case. One more h_post_bda case at the smallest size trains with hidden dropout
0.1 (Megatron's default `hidden_dropout`; `-p0.1` in its id): its bytes model is the ideal kernel's,
which draws the mask in the kernel and saves none (as the compiled backend does: it saves the seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhc_core.analysis import bytes_moved

__all__ = ["PerfCase", "cases_for", "cpu_gap", "OPS"]

OPS = ("sinkhorn", "mapping", "h_aggregate", "h_post_bda", "pre")
_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}
ITERATIONS = 20
"""Sinkhorn iterations of a timed case: the default of `mhc_sinkhorn_iterations`, upstream's."""


@dataclass(frozen=True, kw_only=True)
class PerfCase:
    """One op at one size; `inputs()` builds its arguments, `bytes()` its ideal traffic."""

    op: str
    tokens: int
    n: int
    hidden: int
    dtype: torch.dtype
    device: str
    dropout: float = 0.0
    """h_post_bda only: hidden dropout, in training mode when > 0."""
    iterations: int = ITERATIONS
    """sinkhorn and pre: Sinkhorn iterations (the default's, 20, unless the id says `-it<k>`)."""

    def __post_init__(self) -> None:
        if self.dropout and self.op != "h_post_bda":
            raise ValueError(f"PerfCase.dropout={self.dropout}: only h_post_bda has dropout, not {self.op!r}")
        if self.iterations < 1:
            raise ValueError(f"PerfCase.iterations={self.iterations}: must be >= 1")

    @property
    def id(self) -> str:
        size = (
            f"T{self.tokens}-n{self.n}"
            if self.op == "sinkhorn"
            else f"T{self.tokens}-n{self.n}-C{self.hidden}"
        )
        it = (
            f"-it{self.iterations}"
            if self.iterations != ITERATIONS and self.op in ("sinkhorn", "pre")
            else ""
        )
        return (
            f"{self.op}-{size}-{_DTYPE_NAME[self.dtype]}"
            + (f"-p{self.dropout:g}" if self.dropout else "")
            + it
        )

    def bytes(self, direction: str) -> int:
        """Bytes moved by an ideal kernel (`mhc_core.analysis.bytes_moved`)."""
        act = torch.empty((), dtype=self.dtype).element_size()
        return bytes_moved(
            self.op,
            direction,
            tokens=self.tokens,
            n=self.n,
            hidden=self.hidden,
            act_bytes=act,
            with_bias=True,
        ).total

    def inputs(self, requires_grad: bool) -> tuple:
        """Positional arguments of the op (reference signature), seeded."""
        g = torch.Generator().manual_seed(0)
        t, n, c, dt, dev = self.tokens, self.n, self.hidden, self.dtype, self.device

        def rnd(*shape, dtype=dt, scale=1.0, grad=True):
            x = (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)
            return x.requires_grad_(requires_grad and grad)

        if self.op == "sinkhorn":
            return (rnd(t, n, n, dtype=torch.float32), self.iterations, None, "megatron_main")
        if self.op in ("mapping", "pre"):
            big_n = n * n + 2 * n
            args = (
                rnd(t, n * c),
                rnd(big_n, n * c, dtype=torch.float32, scale=0.02),
                *(rnd(1, dtype=torch.float32, scale=0.01) for _ in range(3)),
                rnd(big_n, dtype=torch.float32, scale=0.01),
                n,
            )
            return (
                (*args, "megatron_main")
                if self.op == "mapping"
                else (*args, self.iterations, "megatron_main")
            )
        if self.op == "h_aggregate":
            return (rnd(t, n, c), rnd(t, n, dtype=torch.float32))
        if self.op == "h_post_bda":
            return (
                rnd(t, n, n, dtype=torch.float32),
                rnd(t, n, c),
                rnd(t, n, dtype=torch.float32),
                rnd(t, c),
                rnd(c),
                self.dropout,
                self.dropout > 0,
                "megatron_main",
            )
        raise ValueError(f"PerfCase.op={self.op!r}; valid: {', '.join(OPS)}")


def cases_for(device: str, *, tokens: int | None = None, iterations: int = ITERATIONS) -> list[PerfCase]:
    """The registry for `device` ("cpu" or "cuda"); `tokens` replaces its token count and `iterations` the Sinkhorn
    iterations of sinkhorn and pre (CI's smoke run: the same ops, dtypes and widths over fewer tokens, with fewer
    unrolled iterations to compile)."""
    if device == "cuda":
        default, sizes = 8192, ((4096, torch.bfloat16), (7168, torch.bfloat16))
    else:
        default, sizes = 4096, ((256, torch.float32), (1024, torch.float32), (2048, torch.bfloat16))
    tokens = default if tokens is None else tokens
    # Sinkhorn's logits are fp32 whatever the activation dtype; its id says so.
    out = [
        PerfCase(
            op="sinkhorn",
            tokens=tokens,
            n=4,
            hidden=sizes[0][0],
            dtype=torch.float32,
            device=device,
            iterations=iterations,
        )
    ]
    for op in OPS[1:]:
        # The fused pre-op at the sizes of its targets only (C 1024 fp32, C 2048 bf16 on CPU): its compiles
        # cost CI's time.
        op_sizes = sizes[1:] if op == "pre" and device == "cpu" else sizes
        out += [
            PerfCase(op=op, tokens=tokens, n=4, hidden=c, dtype=dt, device=device, iterations=iterations)
            for c, dt in op_sizes
        ]
    c, dt = sizes[0]
    out.append(PerfCase(op="h_post_bda", tokens=tokens, n=4, hidden=c, dtype=dt, device=device, dropout=0.1))
    return out


def has_onednn_bf16() -> bool:
    """Whether torch's CPU bf16 GEMMs go through oneDNN on this machine."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_gap(case: PerfCase, direction: str) -> str | None:
    """Why `case` is not timed in `direction` on this CPU, or None.

    The bf16 mapping (and pre) backward (the `megatron_main` variant computes in the activation dtype) needs
    dx = dh @ W, [T, N] @ [N, n*C] with K = N = 24. Where torch has no oneDNN bf16 path (CPUs
    without AVX-512 / AVX-NE-CONVERT, `torch.ops.mkldnn._is_mkldnn_bf16_supported()` False), that
    GEMM runs in torch's scalar fallback: 3.1 s at T 4096, C 2048 on an AVX2 EPYC against 0.05 s in
    fp32, and ~40 s per benchmark. Timed there, the case measures that fallback, not the op's bytes.
    """
    if (
        case.device == "cpu"
        and case.op in ("mapping", "pre")
        and case.dtype == torch.bfloat16
        and direction == "fwdbwd"
        and not has_onednn_bf16()
    ):
        return (
            "torch has no oneDNN bf16 GEMM on this CPU (torch.ops.mkldnn._is_mkldnn_bf16_supported() is "
            f"False): the bf16 {case.op} backward's dx GEMM (K = 24) would time torch's scalar fallback"
        )
    return None
