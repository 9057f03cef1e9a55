"""cuTile (NVIDIA `cuda-tile`) kernels for the four mHC ops, forward and backward.

Importing this package needs neither `cuda.tile` nor a GPU: the kernel modules
(`sinkhorn_kernels`, `stream_kernels`, `mapping_kernels`) are imported on first launch
(`runtime.kernel_module`). The kernels and the wrappers share `constants.py` (no imports at all).

- `availability() -> (bool, reason)`: a CUDA GPU of compute capability >= 8.0, `cuda.tile`
  importable and a `tileiras` compiler found (see `toolchain.py`).
- `CUTILE`: the backend (`mhc_core.ops.contract.Backend`) on this GPU's runtime; `CuTileBackend(runtime)`: the
  same ops bound to another runtime (the lab's CPU emulator, the launch recorder). Each op takes its checked
  call (`mhc_core.ops`: the checks and their `ValueError`s are the reference's, made once at the entry) and is a
  `torch.autograd.Function` (in `sinkhorn.py`, `mapping.py`, `streams.py`) whose forward and backward are
  launches of the family's kernels (`sinkhorn_kernels.py`, `mapping_kernels.py`, `stream_kernels.py`) through
  the runtime (`runtime.py`). Uncovered cases raise `NotImplementedError` naming the case: `n` outside
  `tiling.SUPPORTED_N`, dtypes other than bf16 / fp32 (fp16, fp64), dropout > 0 in training, tensors not on a
  CUDA device, a Sinkhorn iterated in the logits' dtype (`input_dtype_sinkhorn`). Unlike the reference ops, the kernels do not check their inputs for NaN / inf (that check syncs
  the host). Call them through the entries: `mhc_core.ops.mapping(..., backend=CuTileBackend(rt))`.
- Every launch signature, for the export / compile checks, is listed by the lab's
  `tools/cutile/signatures.py` (from the launch wrappers themselves).
- Tiles: `tiling` heuristics, or the tuning for this GPU model that `tuning.resolve` finds
  (`MHC_CUTILE_TUNING`, else a file shipped in `tuned/`), put in force on the first launch.

Details, tiling and the CI checks: `docs/cutile.md`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from mhc_core.kernels.cutile import mapping as _mapping
from mhc_core.kernels.cutile import sinkhorn as _sinkhorn
from mhc_core.kernels.cutile import streams as _streams
from mhc_core.kernels.cutile import tiling
from mhc_core.kernels.cutile.toolchain import find_toolchain
from mhc_core.ops import AggregateCall, Backend, MappingCall, PostBdaCall, PreCall, SinkhornCall

__all__ = ["CUTILE", "SUPPORTED_N", "CuTileBackend", "availability"]


class CuTileBackend:
    """The cuTile ops bound to one runtime (an object with `launch`, or a zero-argument factory of one)."""

    name = "cutile"

    def __init__(self, runtime: Any | Callable[[], Any]):
        self.runtime = runtime
        self._get: Callable[[], Any] = (
            runtime if callable(runtime) and not hasattr(runtime, "launch") else (lambda: runtime)
        )

    def sinkhorn(self, call: SinkhornCall) -> torch.Tensor:
        return _sinkhorn.sinkhorn(self._get, call)

    def mapping(self, call: MappingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _mapping.mapping(self._get, call)

    def h_aggregate(self, call: AggregateCall) -> torch.Tensor:
        return _streams.h_aggregate(self._get, call)

    def h_post_bda(self, call: PostBdaCall) -> torch.Tensor:
        return _streams.h_post_bda(self._get, call)

    def pre(self, call: PreCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mapping, Sinkhorn and aggregate launches in a row, or under `PreTiles(fused=True)`
        (`tiling.pre_tiles`), where the channels fit its tiles, the same forward with a backward that writes one
        gradient of x (`mapping.pre`). In the single-pass form (`PreCall.single_pass`) the mapping, Sinkhorn and
        aggregate launches in a row, the aggregate weighted with the previous sublayer's H_pre (stream 0, copied, at
        the model's entry)."""
        if call.single_pass:
            h_pre, h_post, logits = self.mapping(call.mapping_call())
            h_res = self.sinkhorn(call.sinkhorn_call(logits))
            weights = call.branch_weights(h_pre)
            branch = (
                call.streams()[:, 0, :].clone()
                if weights is None
                else self.h_aggregate(call.aggregate_call(weights))
            )
            return branch, h_pre, h_post, h_res
        fused = _mapping.pre(self._get, call, lambda logits: self.sinkhorn(call.sinkhorn_call(logits)))
        if fused is not None:
            return fused
        h_pre, h_post, logits = self.mapping(call.mapping_call())
        h_res = self.sinkhorn(call.sinkhorn_call(logits))
        return self.h_aggregate(call.aggregate_call(h_pre)), h_pre, h_post, h_res


SUPPORTED_N = tiling.SUPPORTED_N
MIN_COMPUTE_CAPABILITY = (8, 0)
HOPPER_MIN_TILEIRAS = (13, 3)


@functools.cache
def availability() -> tuple[bool, str]:
    """`(True, "...")` when the kernels can run here, else `(False, why not)` (cached)."""
    reasons = []
    cc = None
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU (torch.cuda.is_available() is False)")
    else:
        cc = torch.cuda.get_device_capability()
        if cc < MIN_COMPUTE_CAPABILITY:
            reasons.append(f"GPU compute capability {cc[0]}.{cc[1]} < 8.0 (cuTile needs Ampere or newer)")
    try:
        has_ct = importlib.util.find_spec("cuda.tile") is not None
    except (ImportError, ValueError):
        has_ct = False
    if has_ct:
        try:
            import cuda.tile  # noqa: F401
        except Exception as exc:  # a broken install must not break the dispatch
            reasons.append(f"`import cuda.tile` failed: {exc}")
    else:
        reasons.append("cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')")
    tc = find_toolchain()
    if tc is None:
        reasons.append("no tileiras compiler (pip wheels, PATH or $CUDA_HOME/bin)")
    elif cc is not None and cc[0] == 9 and tc.release < HOPPER_MIN_TILEIRAS:
        reasons.append(f"tileiras {tc.version} cannot target sm_90 (Hopper needs >= 13.3)")
    if reasons or cc is None or tc is None:
        return False, "; ".join(reasons)
    return True, f"cuTile on sm_{cc[0]}{cc[1]} with tileiras {tc.version} ({tc.source})"


@functools.cache
def _default_runtime():
    ok, why = availability()
    if not ok:
        raise RuntimeError(f"cutile backend unavailable: {why}")
    from mhc_core.kernels.cutile import tuning
    from mhc_core.kernels.cutile.runtime import CuTileRuntime

    runtime = CuTileRuntime()
    tuned = tuning.resolve(torch.cuda.get_device_name())
    tiling.set_tuning(tuned)
    logging.getLogger("mhc_core.kernels").info("cuTile tuning: %s", tuning.describe(tuned))
    return runtime


CUTILE: Backend = CuTileBackend(_default_runtime)
"""The cuTile backend on this GPU's runtime (created on the first launch)."""
