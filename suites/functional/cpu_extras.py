"""CPU workarounds the functional runner needs on top of `mhc_core.megatron.cpu_support`.

`cpu_support` covers the model, the schedules and p2p. Training with megatron-core's own DDP,
optimizer and distributed checkpointing reaches five more CUDA-only places (megatron-core
0.16.1). They are patched here the same way (the module-global `torch` of that one module is a
proxy whose `cuda.current_device()` is the CPU, whose `cuda.synchronize()` is a no-op and whose
tensor factories map `device="cuda"` to the CPU), explicitly, reversibly and only without CUDA.
They belong in `cpu_support` (reported to its owner); this module goes away when they are there.

| name | failure point | patch |
|---|---|---|
| `ddp_buffers` | `_ParamAndGradBuffer` allocates grad (and param) buffers on `torch.cuda.current_device()` | shim `megatron.core.distributed.param_and_grad_buffer` |
| `optimizer` | `FP32Optimizer` / `MixedPrecisionOptimizer` create `device='cuda'` scalars | shim `megatron.core.optimizer.optimizer` |
| `clip_grads` | grad norm / zero count create `device='cuda'` buffers | shim `megatron.core.optimizer.clip_grads` |
| `clip_assert` | `clip_grad_by_total_norm_fp32` asserts `grad.type() == 'torch.cuda.FloatTensor'` | the same function without the device assertion, bound in `megatron.core.optimizer.optimizer` |
| `dist_ckpt` | torch_dist save calls `torch.cuda.synchronize()` and reduces on `torch.cuda.current_device()` | shim `...dist_checkpointing.strategies.filesystem_async` and `.state_dict_saver` |
"""

from __future__ import annotations

import importlib
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SHIMMED_MODULES", "install", "installed", "uninstall"]

SHIMMED_MODULES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange")
_CPU = torch.device("cpu")
_UNDO: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def _cpu(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
        return _CPU
    return device


class _Cuda:
    def __init__(self, real: types.ModuleType):
        self._real = real

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Torch(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch", "torch as seen by a megatron-core module patched by suites.functional.cpu_extras")
        self.cuda = _Cuda(torch.cuda)
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _shim(module_name: str) -> Callable[[], None]:
    module = importlib.import_module(module_name)
    original = module.__dict__["torch"]
    module.torch = _Torch()

    def undo() -> None:
        module.torch = original

    return undo


def _clip_without_device_assert() -> Callable[[], None]:
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.utils import to_local_if_dtensor

    original = mopt.clip_grad_by_total_norm_fp32

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """Stock semantics (scale every grad by max_norm / (total_norm + 1e-6) when < 1), any device."""
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                 if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.copy_(g * clip_coeff)  # what local_multi_tensor_scale does

    mopt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

    def undo() -> None:
        mopt.clip_grad_by_total_norm_fp32 = original

    return undo


def install() -> bool:
    """Apply every workaround once; a no-op (False) when CUDA is available."""
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if not _UNDO:
            _UNDO.extend(_shim(m) for m in SHIMMED_MODULES)
            _UNDO.append(_clip_without_device_assert())
    return True


def uninstall() -> None:
    """Revert every workaround, newest first."""
    with _LOCK:
        while _UNDO:
            _UNDO.pop()()


def installed() -> bool:
    return bool(_UNDO)
