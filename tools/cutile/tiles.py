"""The cuTile tiles in force under a tuning, against the heuristics, per tile key (no GPU needed).

    python -m tools.cutile.tiles                       # what MHC_CUTILE_TUNING / tuned/ give on an H200
    python -m tools.cutile.tiles tuning.json --n 4 --hidden 7168

The tuning file, its loader and its resolution are the product's (`mhc_core.kernels.cutile.tuning`).
"""

from __future__ import annotations

from mhc_core.kernels.cutile import tiling, tuning

__all__ = ["tile_of", "tiles_in_force", "main"]


def tile_of(key: str, n: int, hidden: int) -> object:
    """The tile `tiling` gives tile key `key` at `[*, n, hidden]` now."""
    direction = "fwd" if key.endswith("_fwd") else "bwd"
    op = key.removesuffix("_fwd").removesuffix("_bwd")
    if op == "sinkhorn":
        return tiling.sinkhorn_tile(n)
    if op == "mapping":
        return tiling.mapping_tiles(n, n * hidden, direction)
    return (tiling.aggregate_tiles if op == "h_aggregate" else tiling.post_bda_tiles)(n, hidden, direction)


def tiles_in_force(
    tuned: tuning.Tuning | None, n: int, hidden: int
) -> list[tuple[str, object, object, dict]]:
    """`(key, heuristic tile, tile in force under tuning, its kernels' occupancy hints)` per tile key
    at `[*, n, hidden]` under the tuning `tuned`."""
    rows = []
    for key, kernels in tiling.KERNELS_OF.items():
        with tiling.tuned(None):
            plain = tile_of(key, n, hidden)
        with tiling.tuned(tuned):
            rows.append(
                (
                    key,
                    plain,
                    tile_of(key, n, hidden),
                    {k: tiling.occupancy(k) for k in kernels if tiling.occupancy(k) is not None},
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.cutile.tiles [FILE] [--device NAME] [--n 4 --hidden 4096]`: the tiles in force
    (FILE, else what `tuning.resolve` finds for NAME) against the heuristics, per key."""
    import argparse
    import sys

    p = argparse.ArgumentParser(description="cuTile tiles in force under a tuning, against the heuristics")
    p.add_argument(
        "file", nargs="?", help="a tuning file (default: what MHC_CUTILE_TUNING / tuned/ give for --device)"
    )
    p.add_argument(
        "--device",
        default=tuning.REFERENCE_DEVICE,
        help="GPU model name, as torch.cuda.get_device_name() says it",
    )
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args(argv)
    if args.n not in tiling.SUPPORTED_N:
        p.error(f"--n {args.n}: the cuTile kernels exist for n in {tiling.SUPPORTED_N}")
    if args.hidden < 1:
        p.error(f"--hidden {args.hidden}: must be >= 1")
    try:
        t = tuning.load(args.file) if args.file else tuning.resolve(args.device)
    except ValueError as exc:
        print(f"tuning: {exc}", file=sys.stderr)
        return 2
    print(f"tuning: {tuning.describe(t)}; n = {args.n}, C = {args.hidden}")
    print("| key | heuristic | in force | occupancy hints |\n|---|---|---|---|")
    for key, plain, used, hints in tiles_in_force(t, args.n, args.hidden):
        print(f"| {key} | {plain} | {'(same)' if used == plain else used} | {hints or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
