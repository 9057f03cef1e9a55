"""Where the cuTile launches go: `CuTileRuntime`, `ct.launch` on the current torch stream.

The launch wrappers in `ops_*.py` call `runtime.launch(grid, kernel_name, args)` and never touch
`cuda.tile` themselves, so the lab can run the same wrapper code on other runtimes: the CPU kernel
interpreter (`tools.cutile.emulator.EmulatedRuntime`, the parity tests without a GPU) and the launch
recorder (`tools.cutile.recording.RecordingRuntime`, the source of the CI signature list). A runtime
has `launch`, `num_sms(device)` and `check_tensor(t, name, op)`.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling

__all__ = [
    "KERNEL_MODULES",
    "kernel_object",
    "CuTileRuntime",
]

KERNEL_MODULES: dict[str, str] = {
    "sinkhorn_fwd_kernel": "sinkhorn_kernels",
    "sinkhorn_bwd_kernel": "sinkhorn_kernels",
    "sinkhorn_fwd_elem_kernel": "sinkhorn_elem_kernels",
    "sinkhorn_bwd_elem_kernel": "sinkhorn_elem_kernels",
    "h_aggregate_fwd_kernel": "stream_kernels",
    "h_aggregate_bwd_kernel": "stream_kernels",
    "h_post_bda_fwd_kernel": "stream_kernels",
    "h_post_bda_bwd_kernel": "stream_kernels",
    "mapping_fwd_partial_kernel": "mapping_kernels",
    "mapping_fwd_epilogue_kernel": "mapping_kernels",
    "mapping_bwd_coef_kernel": "mapping_kernels",
    "mapping_bwd_dx_dw_kernel": "mapping_kernels",
}
"""Every kernel of the package and the module (in this package) that defines it."""


_AS_TILING = object()


@functools.cache
def _hinted(kernel_name: str, occupancy: int | None):
    kernel = getattr(importlib.import_module(f"mhc_core.kernels.cutile.{KERNEL_MODULES[kernel_name]}"), kernel_name)
    return kernel if occupancy is None else kernel.replace_hints(occupancy=occupancy)


def kernel_object(kernel_name: str, occupancy: int | None | object = _AS_TILING):
    """The `@ct.kernel` object (imports `cuda.tile`) with an occupancy hint: `tiling.occupancy`'s
    (override, tuning, `DEFAULT_OCCUPANCY`) unless `occupancy` is given (None: no hint). The one
    place a hint becomes a kernel, for the GPU runtime, CI's offline compile, the resource report
    and the precompiled cache; each hinted copy is kept (it has its own JIT cache)."""
    return _hinted(kernel_name, tiling.occupancy(kernel_name) if occupancy is _AS_TILING else occupancy)


class CuTileRuntime:
    """Launches on the current CUDA stream with `cuda.tile.launch` (JIT-compiled per signature)."""

    def __init__(self) -> None:
        import cuda.tile as ct

        self._ct = ct
        for name in KERNEL_MODULES:  # import every kernel module now: a broken one fails here, not mid-step
            kernel_object(name, None)

    def launch(self, grid: tuple[int, ...], kernel_name: str, args: tuple[Any, ...]) -> None:
        """Launch on the current stream of the device of the first tensor argument."""
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        kernel = self._kernel(kernel_name)
        if device.index is None or device.index == torch.cuda.current_device():
            self._ct.launch(torch.cuda.current_stream(device), grid, kernel, args)
        else:
            with torch.cuda.device(device):
                self._ct.launch(torch.cuda.current_stream(device), grid, kernel, args)

    def _kernel(self, kernel_name: str):
        """The kernel object with the occupancy hint in force (`kernel_object`)."""
        return kernel_object(kernel_name)

    @staticmethod
    def num_sms(device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count

    @staticmethod
    def check_tensor(t: torch.Tensor, name: str, op: str) -> None:
        if not t.is_cuda:
            raise NotImplementedError(
                f"cutile {op}: {name} is on {t.device}; the cuTile kernels run on CUDA tensors only"
            )
