"""Where the cuTile launches go, and what every launch wrapper needs besides its kernels.

The launch wrappers (`sinkhorn.py`, `mapping.py`, `streams.py`) call `runtime.launch(grid, kernel_name,
args)` and never touch `cuda.tile` themselves, so the lab can run the same wrapper code on other
runtimes: the CPU kernel interpreter (`tools.cutile.emulator.EmulatedRuntime`, the parity tests without a
GPU) and the launch recorder (`tools.cutile.recording.RecordingRuntime`, the source of the CI signature
list). A runtime has `launch`, `num_sms(device)` and `check_tensor(t, name, op)`. `CuTileRuntime` is the
GPU's: `ct.launch` on the current torch stream of the kernel `kernel_object` imports from its family's
module (`sinkhorn_kernels`, `mapping_kernels`, `stream_kernels`).

The wrappers' shared arithmetic and coverage checks are here too: `cdiv`, and the `require_*` checks,
which raise `NotImplementedError` naming a case without a kernel (`n`, dtype, device, dropout in training);
argument errors are the reference's `ValueError`s (`mhc_core.ops`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.constants import DEV, MAIN, PAPER
from mhc_core.variants import VariantSpec

__all__ = [
    "KERNEL_MODULES",
    "SUPPORTED_DTYPES",
    "SINKHORN_FORM_CODE",
    "sinkhorn_code",
    "CuTileRuntime",
    "cdiv",
    "kernel_module",
    "kernel_object",
    "require_device",
    "require_dtypes",
    "require_n",
    "require_no_training_dropout",
]

KERNEL_MODULES: dict[str, str] = {
    "sinkhorn_fwd_kernel": "sinkhorn_kernels",
    "sinkhorn_bwd_kernel": "sinkhorn_kernels",
    "sinkhorn_fwd_elem_kernel": "sinkhorn_kernels",
    "sinkhorn_bwd_elem_kernel": "sinkhorn_kernels",
    "h_aggregate_fwd_kernel": "stream_kernels",
    "h_aggregate_bwd_kernel": "stream_kernels",
    "h_aggregate_bwd_h_kernel": "stream_kernels",
    "h_post_bda_fwd_kernel": "stream_kernels",
    "h_post_bda_bwd_kernel": "stream_kernels",
    "mapping_fwd_partial_kernel": "mapping_kernels",
    "mapping_fwd_epilogue_kernel": "mapping_kernels",
    "mapping_bwd_coef_kernel": "mapping_kernels",
    "mapping_bwd_dx_dw_kernel": "mapping_kernels",
    "pre_bwd_dx_dw_kernel": "mapping_kernels",
}
"""Every kernel of the package and the module (in this package) that defines it."""


def kernel_module(name: str) -> ModuleType:
    """The kernel module `name` of `KERNEL_MODULES` (imports `cuda.tile`): one per op family."""
    from mhc_core.kernels.cutile import mapping_kernels, sinkhorn_kernels, stream_kernels

    modules = {
        "sinkhorn_kernels": sinkhorn_kernels,
        "mapping_kernels": mapping_kernels,
        "stream_kernels": stream_kernels,
    }
    if name not in modules:
        raise ValueError(
            f"cutile: {name!r} is not a kernel module; valid: {sorted(set(KERNEL_MODULES.values()))}"
        )
    return modules[name]


_AS_TILING = object()


@functools.cache
def _hinted(kernel_name: str, occupancy: int | None):
    kernel = getattr(kernel_module(KERNEL_MODULES[kernel_name]), kernel_name)
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


# --- what every launch wrapper shares -------------------------------------------------------------------

SINKHORN_FORM_CODE = {
    ("exp", "col_row", "none"): PAPER,
    ("exp_rowmax", "row_col", "clamp"): MAIN,
    ("softmax_eps", "row_col", "add"): DEV,
}
"""The `VARIANT` constant of the Sinkhorn kernels per Sinkhorn form (`VariantSpec.sinkhorn_form`: start, order,
guard), each code named after the variant that introduced its form: a variant with one of these forms runs on
the kernels as they are; a new form is a new kernel branch."""


def sinkhorn_code(spec: VariantSpec) -> int:
    """The Sinkhorn kernels' `VARIANT` constant for `spec`; `NotImplementedError` naming the form when no kernel
    computes it."""
    try:
        return SINKHORN_FORM_CODE[spec.sinkhorn_form]
    except KeyError:
        raise NotImplementedError(
            f"cutile sinkhorn: no kernel computes the Sinkhorn form (start, order, guard) = {spec.sinkhorn_form} of "
            f"{spec.variant.value}; the kernels compute {sorted(SINKHORN_FORM_CODE)}"
        ) from None


SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for positive `b`: the number of tiles of size `b` covering `a`."""
    return -(-a // b)


def require_n(n: int, op: str) -> None:
    """`NotImplementedError` unless `n` is in `tiling.SUPPORTED_N`."""
    if n not in tiling.SUPPORTED_N:
        raise NotImplementedError(
            f"cutile {op}: n={n} residual streams has no kernel (supported: {tiling.SUPPORTED_N}, "
            "tile shapes must be powers of two)"
        )


def require_no_training_dropout(op: str, dropout_p: float, training: bool) -> None:
    """`NotImplementedError` for dropout in training (the fused bias-dropout-add has none)."""
    if training and dropout_p > 0:
        raise NotImplementedError(
            f"cutile {op}: dropout_p={dropout_p} in training has no kernel (the fused bias-dropout-add "
            "covers dropout_p == 0 or eval only)"
        )


def require_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    """`NotImplementedError` for a tensor (None skipped) whose dtype is not bf16 / fp32."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(
                f"cutile {op}: {name} has dtype {t.dtype}; the kernels support bfloat16 and float32"
            )


def require_device(rt: Any, op: str, **tensors: torch.Tensor | None) -> None:
    """Let the runtime `rt` check each tensor (None skipped), e.g. that it is on a CUDA device."""
    for name, t in tensors.items():
        if t is not None:
            rt.check_tensor(t, name, op)
