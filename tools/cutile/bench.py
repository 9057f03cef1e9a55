"""Quick CUDA-event timing of the cuTile ops against the reference ops (GPU only).

    python -m tools.cutile.bench --tokens 8192 --hidden 4096 --n 4 --dtype bf16 --out out.json

For each op and direction (fwd; bwd alone, replayed on a retained graph) and each backend
(cutile, reference): median milliseconds over `--iters` timed calls after `--warmup` untimed ones
(the first call JIT-compiles the kernels), and GB/s against `mhc_core.analysis.bytes_moved`.
Benchmarks measure; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

from mhc_core.analysis import bytes_moved
from mhc_core.kernels.cutile.tuning import write_json
from mhc_core.kernels.dispatch import bound_ops
from mhc_core.ops import num_mapping_outputs
from mhc_core.variants import get_variant
from tools.timing import pipelined_ms, time_ms

__all__ = [
    "ACT_DTYPES",
    "main",
    "time_ms",
    "pipelined_ms",
    "backward_fn",
    "make_inputs",
    "op_call",
    "add_shape_args",
    "cutile_or_none",
    "write_json",
]


ACT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""`--dtype` of the GPU tools (and a sweep file's `dtype`): the activation dtype it names."""


def add_shape_args(
    p: argparse.ArgumentParser,
    *,
    tokens: int = 8192,
    hidden: int = 4096,
    variant: str = "megatron_dev",
    dtype: bool = True,
) -> None:
    """`--tokens --hidden --n [--dtype] --variant`, the problem options the GPU tools share."""
    p.add_argument("--tokens", type=int, default=tokens)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--n", type=int, default=4)
    if dtype:
        p.add_argument("--dtype", choices=tuple(ACT_DTYPES), default="bf16")
    p.add_argument("--variant", default=variant)


def cutile_or_none(tool: str):
    """The `mhc_core.kernels.cutile` package when it can run here, else None after saying why on stderr."""
    import mhc_core.kernels.cutile as cutile

    ok, why = cutile.availability()
    if not ok:
        print(f"{tool}: cuTile unavailable: {why}", file=sys.stderr)
        return None
    return cutile


def backward_fn(fn: Callable, inputs: list[torch.Tensor | None]) -> Callable[[], object]:
    """Runs `fn(*inputs)` once and returns the backward alone, replayable: the gradients of all
    non-None inputs for random output gradients, on the retained graph."""
    res = fn(*inputs)
    outs = res if isinstance(res, tuple) else (res,)
    grads = [torch.randn_like(o) for o in outs]
    leaves = [x for x in inputs if x is not None]
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


def make_inputs(
    op: str, t: int, n: int, c: int, act: torch.dtype, variant: str, device: str = "cuda"
) -> list[torch.Tensor | None]:
    """Random arguments of `op` (reference signature) on `device`. Sinkhorn's logits have scale 3, so
    that 20 iterations leave them far from converged and a backward that walks back through the
    wrong states is far off, for the sweep's reference check (the gradients of 18 and 20 iterations
    differ by 3.7e-3 relative at scale 3, by 2e-5 at scale 1; one pair off, 1.9-2.2e-3)."""
    dev = device
    coef = act if get_variant(variant).coefficients_in_activation_dtype else torch.float32
    big_n = num_mapping_outputs(n)
    if op in ("mapping", "pre"):
        return [
            torch.randn(t, n * c, device=dev, dtype=act),
            torch.randn(big_n, n * c, device=dev) * 0.01,
            *(torch.full((1,), 0.01, device=dev) for _ in range(3)),
            torch.zeros(big_n, device=dev),
        ]
    if op == "sinkhorn":
        return [(torch.randn(t, n, n, device=dev) * 3).to(coef)]
    if op == "h_aggregate":
        return [torch.randn(t, n, c, device=dev, dtype=act), torch.rand(t, n, device=dev, dtype=coef)]
    return [
        torch.rand(t, n, n, device=dev, dtype=coef),
        torch.randn(t, n, c, device=dev, dtype=act),
        torch.rand(t, n, device=dev, dtype=coef),
        torch.randn(t, c, device=dev, dtype=act),
        torch.randn(c, device=dev, dtype=act),
    ]


def op_call(ops, op: str, n: int, variant: str, iterations: int) -> Callable:
    if op == "mapping":
        return lambda *a: ops.mapping(*a, n, variant)
    if op == "pre":
        return lambda *a: ops.pre(*a, n, iterations, variant)
    if op == "sinkhorn":
        return lambda z: ops.sinkhorn(z, iterations, None, variant)
    if op == "h_aggregate":
        return ops.h_aggregate
    return lambda *a: ops.h_post_bda(*a, 0.0, False, variant)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--iterations", type=int, default=20, help="Sinkhorn iterations")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ops", default="sinkhorn,mapping,h_aggregate,h_post_bda,pre")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)

    cutile = cutile_or_none("bench")
    if cutile is None:
        return 2
    act = ACT_DTYPES[args.dtype]
    t, n, c = args.tokens, args.n, args.hidden
    rows = []
    for op in args.ops.split(","):
        for backend, ops in (("cutile", bound_ops(cutile.CUTILE)), ("reference", bound_ops("reference"))):
            fn = op_call(ops, op, n, args.variant, args.iterations)
            inputs = [
                x.requires_grad_(True) if x is not None else None
                for x in make_inputs(op, t, n, c, act, args.variant)
            ]
            fwd_ms = time_ms(functools.partial(fn, *inputs), args.warmup, args.iters)
            bwd = backward_fn(fn, inputs)
            bwd_ms = time_ms(bwd, args.warmup, args.iters)
            for direction, ms in (("fwd", fwd_ms), ("bwd", bwd_ms)):
                model = bytes_moved(
                    op,
                    direction,
                    tokens=t,
                    n=n,
                    hidden=c,
                    act_bytes=act.itemsize,
                    with_bias=op == "h_post_bda",
                )
                rows.append(
                    {
                        "op": op,
                        "direction": direction,
                        "backend": backend,
                        "median_ms": round(ms, 4),
                        "model_bytes": model.total,
                        "gb_per_s": round(model.total / (ms * 1e6), 1),
                    }
                )
                print(
                    f"{op:12s} {direction} {backend:9s} {ms:9.4f} ms {model.total / (ms * 1e6):8.1f} GB/s",
                    flush=True,
                )
            del bwd, inputs
            torch.cuda.empty_cache()
    result = {
        "tokens": t,
        "n": n,
        "hidden": c,
        "dtype": args.dtype,
        "variant": args.variant,
        "device": torch.cuda.get_device_name(),
        "availability": cutile.availability()[1],
        "rows": rows,
    }
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
