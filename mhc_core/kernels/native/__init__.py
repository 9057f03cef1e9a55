"""Native (C) CPU kernels of the compiled backend: the fused pre-op's passes over the streams.

Inductor cannot give the pre-op's forward one read of `x`: the 24-column projection is an extern GEMM, so
the sum of squares and the aggregate each read `x` again. `_pre` (`pre.c` and its SIMD template
`pre_simd.h`, built by the package's own install from `setup.py`; optional, so an install without a C
compiler simply lacks it) reads each block of tokens once for the projection and the sum of squares and,
while the rows are in cache, computes h_pre and the aggregate. It runs where the mapping computes in fp32
(every variant with fp32 activations, and `fp32_mappings` with bf16 ones) or in bf16 on bf16 activations
(the projection then rounded to bf16, as a bf16 GEMM's output, the rest in fp32 as the compiled graph);
the compiled backend's `pre` uses it on CPU tensors when `available()`, else its torch.compile forward.

Four kernels, by name (`KERNELS`): `avx512_bf16` (`avx512`, whose forward takes the projection and the sum of
squares, and whose backward `g_x` and `g_W`, from dot products of bf16 pairs, `vdpbf16ps`, where the mapping
computes in bf16 on bf16 x: the products exact, summed in fp32, twice as many per instruction), `avx512`
(AVX-512 F/BW/VL), `avx2` (AVX2 + FMA) and `portable`; each sums in its own order, so they differ by rounding,
and each is deterministic; the tokens are split over torch's intra-op threads (`torch.get_num_threads()`),
which changes no bit of the forward and of `g_x`. `MHC_NATIVE` chooses: unset,
`1` or `auto` the fastest this CPU runs, `0` none (the torch.compile forward), a kernel's name that kernel
(an error where the CPU lacks it: never a silent fallback). Unset, a CPU without AVX2 gets the compiled graph:
the scalar kernel is for tests and such forcing only.

    proj [T, N], rms [T, 1], h_pre [T, n], aggregate [T, C] = pre_forward(x [T, n*C], weight [N, n*C], ...)
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = [
    "ENV",
    "KERNELS",
    "MAX_N",
    "MIN_TOKENS_PER_THREAD",
    "auto_kernel",
    "available",
    "built",
    "chosen_kernel",
    "grad_h",
    "grad_x_w",
    "kernels",
    "passes",
    "pre_forward",
]

ENV = "MHC_NATIVE"
KERNELS = ("avx512_bf16", "avx512", "avx2", "portable")
MIN_TOKENS_PER_THREAD = 64
"""Below this many tokens per thread, starting a thread costs more than its share of the work."""
MAX_N = 8
"""The most residual streams the kernels take (`pre.c`, `MAX_N`)."""


def passes(x_dtype: torch.dtype, compute: torch.dtype, n: int, kernel: str | None) -> tuple[bool, bool]:
    """Which of pre's passes `kernel` takes (None: no native kernel runs, neither) for activations `x_dtype` and a
    mapping computed in `compute`: the forward for fp32 / bf16 activations with the mapping in fp32 or in their
    own dtype and n <= `MAX_N`; the backward where, further, the mapping computes in fp32, or in bf16 under
    `avx512_bf16` (its bf16 dot products, 60 against 76 ms fwd+bwd at C 2048 on one thread; with fp32 FMAs the
    compiled graph's bf16 GEMMs, oneDNN with AVX-512 BF16, were faster: 81 against 73 ms)."""
    if kernel is None:
        return False, False
    forward = (
        x_dtype in (torch.float32, torch.bfloat16) and compute in (torch.float32, x_dtype) and n <= MAX_N
    )
    return forward, forward and (compute == torch.float32 or kernel == "avx512_bf16")


@functools.cache
def _module():
    try:
        from mhc_core.kernels.native import _pre
    except ImportError as exc:
        return (
            None,
            f"mhc_core.kernels.native._pre is not built ({exc}; `pip install -e .` builds it with a C compiler)",
        )
    return _pre, "built"


@functools.cache
def kernels() -> tuple[str, ...]:
    """The kernels this CPU runs, the fastest first (empty where `_pre` is not built); asked of the CPU once,
    since every compiled `pre` call consults it."""
    module, _ = _module()
    return () if module is None else tuple(module.kernels())


def built() -> tuple[bool, str]:
    """Whether `_pre` is built (the kernels can be called by name), and why not."""
    module, why = _module()
    return module is not None, why


def auto_kernel() -> str | None:
    """The kernel `auto` picks here: the fastest this CPU runs, None where that is the scalar one (or none is built)."""
    here = kernels()
    return here[0] if here and here[0] != "portable" else None


def chosen_kernel() -> str | None:
    """The kernel `MHC_NATIVE` selects here: None where it is `0`, `_pre` is not built, or (unset, `1`, `auto`)
    the CPU runs no SIMD kernel (the scalar one is ~25x slower than the compiled graph; `MHC_NATIVE=portable`
    still forces it); ValueError, naming the value, for one that is no kernel or a kernel this CPU lacks."""
    value = os.environ.get(ENV, "1").strip() or "1"
    if value == "0" or _module()[0] is None:
        return None
    if value in ("1", "auto"):
        return auto_kernel()
    here = kernels()
    if value not in KERNELS:
        raise ValueError(f"{ENV}={value!r} is none of 0, 1, auto, {', '.join(KERNELS)}")
    if value not in here:
        raise ValueError(
            f"{ENV}={value!r}: this CPU lacks that kernel's instructions (it runs {', '.join(here)})"
        )
    return value


def available() -> tuple[bool, str]:
    """Whether the native forward runs here (built, and not turned off with `MHC_NATIVE=0`), and why, naming
    the kernel; a malformed or unrunnable `MHC_NATIVE` is a ValueError (`chosen_kernel`)."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False, f"turned off ({ENV}=0)"
    module, why = _module()
    if module is None:
        return False, why
    kernel = chosen_kernel()
    if kernel is None:
        return (
            False,
            "no SIMD kernel for this CPU (AVX2 or AVX-512; MHC_NATIVE=portable forces the scalar one)",
        )
    return True, f"native pre-op kernels ({kernel})"


def _resolve(kernel: str | None, threads: int | None, t: int) -> tuple[Any, str, int]:
    module, why = _module()
    if module is None:
        raise RuntimeError(why)
    if kernel is None:
        kernel = chosen_kernel()
        if kernel is None:
            raise RuntimeError(f"native pre-op: {available()[1]}")
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), t // MIN_TOKENS_PER_THREAD))
    return module, kernel, int(threads)


def _check_x(fn: str, x: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(
            f"native {fn}: x must be a 2-d CPU fp32 / bf16 tensor, got {x.dtype} {tuple(x.shape)} on "
            f"{x.device}"
        )


def pre_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    alpha_pre: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    norm_eps: float,
    eps_inside: bool,
    h_pre_eps: float,
    h_pre_dtype: torch.dtype,
    compute: torch.dtype = torch.float32,
    kernel: str | None = None,
    threads: int | None = None,
    mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass (see the module docstring) on CPU tensors: x `[T, n*C]` fp32 or bf16, weight `[N, n*C]`,
    alpha_pre `[1]`, bias `[N]`, each rounded to `compute` (the mapping's dtype: fp32, or bf16 with bf16 x)
    on the way in; h_pre rounded to `h_pre_dtype` (fp32 or bf16) before it weights the streams, or, in the
    single-pass form, `mix [T, n]` (fp32 or bf16: the previous sublayer's H_pre) weights them instead. Returns
    `proj [T, N]` in `compute`, `rms [T, 1]` fp32, `h_pre [T, n]` in `h_pre_dtype`, `aggregate [T, C]` in x's
    dtype. `kernel`: one of `KERNELS` (tests, benchmarks), else `MHC_NATIVE`'s choice. `threads`: how many
    threads split the tokens (default torch's intra-op count, at most one per `MIN_TOKENS_PER_THREAD` tokens);
    the results do not depend on it."""
    _check_x("pre_forward", x)
    module, kernel, threads = _resolve(kernel, threads, x.shape[0])
    if h_pre_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native pre_forward: h_pre_dtype must be fp32 or bf16, got {h_pre_dtype}")
    if compute not in (torch.float32, x.dtype):
        raise ValueError(
            f"native pre_forward: the mapping computes in fp32 or in x's dtype ({x.dtype}), got {compute}"
        )
    x = x.contiguous()
    t, k = x.shape
    big_n = n * n + 2 * n
    if mix is not None:
        if mix.dtype not in (torch.float32, torch.bfloat16) or tuple(mix.shape) != (t, n):
            raise ValueError(
                f"native pre_forward: mix must be [T, n] = [{t}, {n}] fp32 or bf16, got {mix.dtype} "
                f"{list(mix.shape)}"
            )
        mix = mix.detach().to(torch.float32).contiguous()
    w = weight.detach().to(compute).to(torch.float32).contiguous()
    b = bias.detach().to(compute).to(torch.float32)[:n].contiguous()
    alpha = float(alpha_pre.detach().to(compute))
    proj = torch.empty(t, big_n, dtype=torch.float32)
    rms = torch.empty(t, 1, dtype=torch.float32)
    h_pre = torch.empty(t, n, dtype=torch.float32)
    agg = torch.empty(t, k // n, dtype=x.dtype)
    module.forward(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        t,
        k,
        n,
        w.data_ptr(),
        alpha,
        b.data_ptr(),
        float(norm_eps),
        int(eps_inside),
        float(h_pre_eps),
        int(h_pre_dtype == torch.bfloat16),
        int(compute == torch.bfloat16),
        proj.data_ptr(),
        rms.data_ptr(),
        h_pre.data_ptr(),
        agg.data_ptr(),
        0 if mix is None else mix.data_ptr(),
        kernel,
        threads,
    )
    return proj.to(compute), rms, h_pre.to(h_pre_dtype), agg


def grad_h(
    x: torch.Tensor, g_agg: torch.Tensor, n: int, kernel: str | None = None, threads: int | None = None
) -> torch.Tensor:
    """The backward's first pass: the aggregate's gradient of h_pre, `[T, n]` fp32 with
    `[t, i] = sum_c g_agg[t, c] x[t, i*C + c]` (x `[T, n*C]`, g_agg `[T, C]` rounded to x's dtype)."""
    _check_x("grad_h", x)
    module, kernel, threads = _resolve(kernel, threads, x.shape[0])
    x = x.contiguous()
    t, k = x.shape
    g_agg = g_agg.to(x.dtype).contiguous()
    if g_agg.shape != (t, k // n):
        raise ValueError(f"native grad_h: g_agg {tuple(g_agg.shape)} must be [T, C] = [{t}, {k // n}]")
    out = torch.empty(t, n, dtype=torch.float32)
    module.grad_h(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        t,
        k,
        n,
        g_agg.data_ptr(),
        out.data_ptr(),
        kernel,
        threads,
    )
    return out


def grad_x_w(
    x: torch.Tensor,
    g_agg: torch.Tensor,
    weight: torch.Tensor,
    g_proj: torch.Tensor,
    coef: torch.Tensor,
    h_pre: torch.Tensor,
    n: int,
    need_x: bool,
    need_w: bool,
    kernel: str | None = None,
    threads: int | None = None,
    bf16_products: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward's second pass, one read of x and g_agg per block of tokens: `g_x [T, n*C]` in x's dtype
    `= g_proj @ W + coef * x + h_pre (x) g_agg` (summed in fp32, rounded once) where `need_x`, and
    `g_w [N, n*C]` fp32 `= g_proj^T @ x` where `need_w`. weight `[N, n*C]`, g_proj `[T, N]`, coef `[T, 1]` and
    h_pre `[T, n]` are read as fp32 (round them to the mapping's dtype first, as its GEMMs would).
    `bf16_products` (a mapping computed in bf16): weight and g_proj are rounded to bf16 here, and with bf16 x the
    `avx512_bf16` kernel takes their products, and x's with g_proj, from dot products of bf16 pairs."""
    _check_x("grad_x_w", x)
    module, kernel, threads = _resolve(kernel, threads, x.shape[0])
    x = x.contiguous()
    t, k = x.shape
    big_n = n * n + 2 * n
    g_agg = g_agg.to(x.dtype).contiguous()
    exact = torch.bfloat16 if bf16_products else torch.float32
    f32 = {
        name: v.detach().to(dtype).to(torch.float32).contiguous()
        for name, v, dtype in (
            ("weight", weight, exact),
            ("g_proj", g_proj, exact),
            ("coef", coef, torch.float32),
            ("h_pre", h_pre, torch.float32),
        )
    }
    want = {
        "g_agg": (g_agg, (t, k // n)),
        "weight": (f32["weight"], (big_n, k)),
        "g_proj": (f32["g_proj"], (t, big_n)),
        "coef": (f32["coef"].view(-1), (t,)),
        "h_pre": (f32["h_pre"], (t, n)),
    }
    for name, (v, shape) in want.items():
        if tuple(v.shape) != shape:
            raise ValueError(f"native grad_x_w: {name} {tuple(v.shape)} must be {list(shape)}")
    g_x = torch.empty_like(x) if need_x else None
    g_w = torch.empty(big_n, k, dtype=torch.float32) if need_w else None
    module.grad_x_w(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        t,
        k,
        n,
        g_agg.data_ptr(),
        f32["weight"].data_ptr(),
        f32["g_proj"].data_ptr(),
        f32["coef"].data_ptr(),
        f32["h_pre"].data_ptr(),
        0 if g_x is None else g_x.data_ptr(),
        0 if g_w is None else g_w.data_ptr(),
        int(bf16_products),
        kernel,
        threads,
    )
    return g_x, g_w
