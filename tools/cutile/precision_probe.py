"""How exact the fp32 mapping projection is on this GPU, per tensor-core mode (GPU only).

    python -m tools.cutile.precision_probe --tokens 1100 --hidden 1024 --n 4

Runs the cuTile `mapping` forward with fp32 activations twice, 3xTF32 (the default) and plain TF32
(`torch.backends.cuda.matmul.allow_tf32 = True`), and torch's own fp32 reference, and prints the
max abs error of each output against the reference evaluated in fp64. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mhc_core import ops as ref
from tools.cutile.bench import add_shape_args, cutile_or_none, write_json

__all__ = ["main"]


def _max_err(outs, oracle) -> list[float]:
    return [float((a.double() - b).abs().max()) for a, b in zip(outs, oracle, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, tokens=1100, hidden=1024, variant="megatron_main", dtype=False)
    p.add_argument("--out", help="write the errors as JSON here")
    args = p.parse_args(argv)

    cutile = cutile_or_none("precision_probe")
    if cutile is None:
        return 2
    t, n, c = args.tokens, args.n, args.hidden
    gen = torch.Generator().manual_seed(0)
    big_n = ref.num_mapping_outputs(n)
    inputs = [
        torch.randn(t, n * c, generator=gen),
        torch.randn(big_n, n * c, generator=gen) * 0.05,
        torch.tensor([0.7]),
        torch.tensor([-0.4]),
        torch.tensor([1.3]),
        torch.randn(big_n, generator=gen) * 0.5,
    ]
    x, w, a_pre, a_post, a_res, b = (v.cuda() for v in inputs)
    oracle = ref.mapping(
        x.double(),
        w.double(),
        a_pre.double(),
        a_post.double(),
        a_res.double(),
        b.double(),
        n=n,
        variant=args.variant,
    )
    result = {
        "tokens": t,
        "n": n,
        "hidden": c,
        "variant": args.variant,
        "outputs": ["h_pre", "h_post", "h_res_logits"],
    }
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, tf32 in (("cutile_3xtf32", False), ("cutile_tf32", True), ("torch_fp32", False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            fn = ref.mapping if name.startswith("torch") else cutile.mapping
            with torch.no_grad():
                result[name] = _max_err(fn(x, w, a_pre, a_post, a_res, b, n=n, variant=args.variant), oracle)
            print(
                f"{name:14s} max abs err vs fp64 (h_pre, h_post, h_res_logits): "
                + ", ".join(f"{e:.3e}" for e in result[name]),
                flush=True,
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
