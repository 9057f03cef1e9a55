"""The cuTile lab: tile sweep and its candidates, adoption checks, bench, ahead-of-time cache, resource
report, precision probe. The kernels, their wrappers, tiles and the tuned-file loader are
`mhc_core.kernels.cutile`; docs: `tools/README.md`."""
