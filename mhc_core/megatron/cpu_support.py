"""Run megatron-core on a machine without CUDA (gloo, CPU tensors): explicit, reversible patches.

megatron-core assumes a GPU in a handful of places that a CPU run reaches. Each place is one
`Workaround` below; `install()` applies them, `uninstall()` reverts them, `cpu_support()` does both
around a block. Nothing happens at import, and on a machine where `torch.cuda.is_available()`
`install()` / `cpu_support()` apply nothing (the stock code is right there).

| name | failure point (megatron-core 0.16.1) | patch |
|---|---|---|
| `rng_tracker` | `model_parallel_cuda_manual_seed` -> `CudaRNGStatesTracker.add` calls `torch.cuda.get_rng_state()`; `fork()` (embedding / attention dropout, GPU weight init) swaps CUDA generator states | `add` / `fork` keep named CPU generator states instead |
| `checkpoint_rng` | activation recompute (`tensor_parallel.checkpoint`, `CheckpointWithoutOutput`: selective recompute of the layernorms / MLP) saves and restores the CUDA generator via `_get_cuda_rng_state` / `_set_cuda_rng_state` | there is no CUDA generator: save nothing, restore nothing (the CPU state and the tracker states are still saved and restored) |
| `memory_buffer` | `GlobalMemoryBuffer.get_tensor` (local-spec `DotProductAttention`) allocates on `torch.cuda.current_device()` | `megatron.core.utils` sees a torch whose `cuda.current_device()` is the CPU |
| `rotary` | `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` (and `__init__` without `use_cpu_initialization`) | same shim in `...embeddings.rotary_pos_embedding` |
| `schedules` | `forward_backward_no_pipelining` / `..._pipelining_*` create `total_num_tokens` with `device="cuda"` | same shim in `megatron.core.pipeline_parallel.schedules`: factory `device="cuda"` -> CPU |
| `p2p` | `P2PCommunicator` allocates receive buffers on `torch.cuda.current_device()` and calls `torch.cuda.synchronize()` after batched p2p | same shim in `megatron.core.pipeline_parallel.p2p_communication`; `synchronize` is a no-op |
| `ddp_buffers` | `DistributedDataParallel` -> `_ParamAndGradBuffer` allocates the grad buffer (and, with the distributed optimizer, the param buffer) on `torch.cuda.current_device()`; 0.19 also waits on `torch.cuda.current_stream()` in `start_grad_sync` | same shim in `megatron.core.distributed.param_and_grad_buffer` |
| `optimizer` | `get_megatron_optimizer` -> `FP32Optimizer` / `MixedPrecisionOptimizer` create their scale, found-inf and overflow scalars with `device='cuda'` | same shim in `megatron.core.optimizer.optimizer` |
| `param_types` | bf16 / fp16 training: `Float16OptimizerWithFloat16Params` and `DistributedOptimizer` build their fp32 main parameters only for `param.type()` in `torch.cuda.{Half,BFloat16,Float}Tensor`, else raise `TypeError` | during their `__init__`, `Tensor.type()` names a CPU tensor as its CUDA type |
| `clip_grads` | `optimizer.step()` -> `get_grad_norm_fp32` / `count_zeros_fp32` create their buffers with `device='cuda'` | same shim in `megatron.core.optimizer.clip_grads` |
| `clip_assert` | `optimizer.step()` with `clip_grad > 0` -> `clip_grad_by_total_norm_fp32` asserts `param.grad.type() == 'torch.cuda.FloatTensor'` | `megatron.core.optimizer.optimizer` calls a copy that asserts fp32 grads on any device and scales them the same way |
| `dist_ckpt` | `dist_checkpointing.save` (torch_dist) calls `torch.cuda.synchronize()` after staging the tensors (`...strategies.filesystem_async`) and reduces / broadcasts its flags on the CUDA device (`...strategies.state_dict_saver`) | same shim in both modules |
| `moe` | the MoE router and its aux-loss tracking call `torch.cuda.current_device()`, the alltoall dispatcher creates a `torch.cuda.Stream`, the expert-parallel gathers allocate on the CUDA device; 0.16.1 without TE reads an undefined `te_general_gemm` in the router; the alltoall's split sizes stay tensors | the shim in the router, `moe_utils`, the token dispatcher and `tensor_parallel.mappings`; `te_general_gemm = None`; split sizes leave as numpy arrays |
| `mtp` | the MTP loss tracker (`MTPLossLoggingHelper.save_loss_to_tracker`) allocates on `torch.cuda.current_device()`; with pipeline stages the MTP stage's `LanguageModule.setup_embeddings_and_output_layer` calls `.cuda()` on the embedding weight it all-reduces | the shim in `megatron.core.transformer.multi_token_prediction`; `Tensor.cuda` is the identity during that one method |
| `sequence_parallel` | under sequence parallelism the tensor-parallel linears' backward (`LinearWithGradAccumulationAndAsyncCommunication`) allocates its reduce-scatter output on `torch.cuda.current_device()` | the shim in `megatron.core.tensor_parallel.layers` |
| `nvtx` | upstream Megatron-LM's mHC ops (`hyper_connection.py` on main and dev) open profiling ranges with `torch.cuda.nvtx.range` / `nvtx_decorator`; torch's CPU wheel has no NVTX and raises `RuntimeError: NVTX functions not installed` | where torch has no NVTX (`torch.cuda.nvtx._nvtx` is torch's stub), the ranges are no-ops; a build with NVTX is left alone |

The "shim" replaces the module-global name `torch` in that one megatron-core module by a thin
proxy that forwards every attribute to torch except the CUDA-only calls above
(`cuda.current_device()` is the CPU, `cuda.synchronize()` is a no-op, `cuda.current_stream()` is
a stream whose waits are no-ops, tensor factories map a CUDA `device=` to the CPU); restoring the
global undoes it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "WORKAROUNDS",
    "Workaround",
    "cpu_support",
    "install",
    "installed",
    "needed",
    "uninstall",
]

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn")
_CPU = torch.device("cpu")


def _cpu_device(device: Any) -> Any:
    """`device` with every CUDA device replaced by the CPU (anything else unchanged)."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU  # a bare index means a CUDA ordinal
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return _CPU
    return device


class _NoEvent:
    """An event on the CPU's one stream: already complete when recorded."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _NoStream:
    """The CPU's one stream, in program order: waiting on an event or another stream is a no-op."""

    def record_event(self, event: Any = None) -> _NoEvent:
        return _NoEvent()

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


_NO_STREAM = _NoStream()


class _CudaOnCpu:
    """Stands in for `torch.cuda` inside one patched module: the current device is the CPU."""

    def __init__(self, real: types.ModuleType):
        self._real = real

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def current_stream(device: Any = None) -> _NoStream:
        return _NO_STREAM

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _NoStream:  # noqa: N802 - torch.cuda's name
        return _NO_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _TorchOnCpu(types.ModuleType):
    """Stands in for `torch` inside one patched module; forwards everything else to torch."""

    def __init__(self) -> None:
        super().__init__("torch", "torch, as seen by a megatron-core module patched by mhc_core cpu_support")
        self.cuda = _CudaOnCpu(torch.cuda)
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        factory.__name__ = factory.__qualname__ = fn.__name__
        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _shim_module(module_name: str) -> Callable[[], None]:
    module: Any = importlib.import_module(module_name)
    original = module.__dict__.get("torch")  # torch, or another tool's proxy: restored on undo
    if not isinstance(original, types.ModuleType):
        raise RuntimeError(
            f"cpu_support: {module_name} has no module-global torch to shim; this megatron-core "
            "version needs a new workaround"
        )
    module.torch = _TorchOnCpu()

    def undo() -> None:
        module.torch = original

    return undo


def _shim_modules(*module_names: str) -> Callable[[], None]:
    """`_shim_module` for several modules as one patch (all or none); undo reverts them newest first."""
    undos: list[Callable[[], None]] = []
    try:
        for name in module_names:
            undos.append(_shim_module(name))
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()

    return undo_all


def _patch_rng_tracker() -> Callable[[], None]:
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CudaRNGStatesTracker
    originals = {"add": cls.__dict__["add"], "fork": cls.__dict__["fork"]}
    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    def add(self: Any, name: str, seed: int) -> None:
        """Track a named generator state seeded with `seed` (a CPU generator state)."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = default_name) -> Iterator[None]:
        """Run the block on the named state; the default CPU stream is left where it was."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state, outer_name = torch.get_rng_state(), self._current_state_name
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    cls.add, cls.fork = add, fork

    def undo() -> None:
        cls.add, cls.fork = originals["add"], originals["fork"]

    return undo


def _patch_checkpoint_rng() -> Callable[[], None]:
    from megatron.core.tensor_parallel import random as mrandom

    originals = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)

    def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        """No CUDA generator to save: an empty state."""
        return torch.empty(0, dtype=torch.uint8)

    def set_state(*args: Any, **kwargs: Any) -> None:
        """No CUDA generator to restore."""
        return None

    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = get_state, set_state

    def undo() -> None:
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = originals

    return undo


def _patch_clip_assert() -> Callable[[], None]:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.utils import to_local_if_dtensor

    original = moptimizer.__dict__.get("clip_grad_by_total_norm_fp32")
    if original is None:
        raise RuntimeError(
            "cpu_support: megatron.core.optimizer.optimizer does not call clip_grad_by_total_norm_fp32; "
            "this megatron-core version needs a new workaround"
        )

    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: float | torch.Tensor, use_decoupled_grad: bool = False
    ) -> None:
        """megatron-core's `clip_grad_by_total_norm_fp32` on any device: every grad (fp32; with
        `use_decoupled_grad`, fp32 or bf16 `decoupled_grad`) is scaled in place by
        `max_norm / (total_norm + 1e-6)` when that is below 1 (the stock function also asserts that
        the grads are `torch.cuda.FloatTensor`s and allocates a "cuda" overflow buffer)."""
        grads = []
        for param in parameters:
            if use_decoupled_grad:
                grad = getattr(param, "decoupled_grad", None)
                if grad is not None:
                    assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
                    grads.append(to_local_if_dtensor(grad).detach())
            elif param.grad is not None:
                assert param.grad.dtype == torch.float32, f"expected fp32 grads, got {param.grad.dtype}"
                grads.append(to_local_if_dtensor(param.grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):  # newer megatron-core: a tensor norm, clamped at 1
            clip_coeff = clip_coeff.clamp_max(1.0)
            for grad in grads:
                grad.mul_(clip_coeff)  # what multi_tensor_scale_tensor does
        elif clip_coeff < 1.0:
            overflow_buf = torch.zeros(1, dtype=torch.int)  # the stock one is on "cuda"; unused on CPU
            clip_grads.multi_tensor_applier(
                clip_grads.multi_tensor_scale_impl, overflow_buf, [grads, grads], clip_coeff
            )

    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

    def undo() -> None:
        moptimizer.clip_grad_by_total_norm_fp32 = original

    return undo


class _NoNvtx:
    """NVTX on a torch without it: every range and mark is a no-op (push / pop report depth 0)."""

    @staticmethod
    def rangePushA(msg: str) -> int:  # noqa: N802 (torch._C._nvtx's names)
        return 0

    @staticmethod
    def rangePop() -> int:  # noqa: N802
        return 0

    @staticmethod
    def rangeStartA(msg: str) -> int:  # noqa: N802
        return 0

    @staticmethod
    def rangeEnd(range_id: int) -> None:  # noqa: N802
        return None

    @staticmethod
    def markA(msg: str) -> None:  # noqa: N802
        return None


def _patch_nvtx() -> Callable[[], None]:
    import torch.cuda.nvtx as nvtx

    original = nvtx._nvtx
    if type(original).__name__ != "_NVTXStub":  # a torch with NVTX: its ranges work without a GPU
        return lambda: None
    nvtx._nvtx = _NoNvtx()  # type: ignore[assignment]  # a stand-in for torch's NVTX stub module

    def undo() -> None:
        nvtx._nvtx = original

    return undo


def _patch_moe() -> Callable[[], None]:
    """The MoE modules' torch shimmed; `moe_utils.te_general_gemm` defined as None where transformer_engine is
    absent (megatron-core 0.16.1 imports it only with TE, then reads it unconditionally in the router's GEMM)."""
    undo_modules = _shim_modules(
        "megatron.core.transformer.moe.router",
        "megatron.core.transformer.moe.moe_utils",
        "megatron.core.transformer.moe.token_dispatcher",
        "megatron.core.tensor_parallel.mappings",
    )
    moe_utils: Any = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher: Any = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    defined = "te_general_gemm" not in moe_utils.__dict__
    if defined:
        moe_utils.te_general_gemm = None
    to_host = dispatcher.maybe_move_tensor_to_cpu

    def to_host_on_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # The split sizes of the alltoall leave as numpy arrays, which all_to_all_single takes as lists; the stock
        # function converts only CUDA tensors, so on the CPU they stayed tensors, which it refuses.
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.detach().numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = to_host_on_cpu

    def undo() -> None:
        dispatcher.maybe_move_tensor_to_cpu = to_host
        if defined:
            del moe_utils.te_general_gemm
        undo_modules()

    return undo


def _patch_mtp() -> Callable[[], None]:
    """The MTP module's torch shimmed (its loss tracker); `LanguageModule.setup_embeddings_and_output_layer`
    with `Tensor.cuda` as the identity for the duration of one call (it moves the shared embedding weight
    to the GPU before the all-reduce that ties the MTP stage's copy to the first stage's)."""
    undo_module = _shim_module("megatron.core.transformer.multi_token_prediction")
    language_module: Any = importlib.import_module(
        "megatron.core.models.common.language_module.language_module"
    )
    cls = language_module.LanguageModule
    original = cls.__dict__["setup_embeddings_and_output_layer"]

    @functools.wraps(original)
    def setup_on_cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
        real_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]  # on the CPU only, restored below
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = real_cuda  # type: ignore[method-assign]  # the original, put back

    cls.setup_embeddings_and_output_layer = setup_on_cpu  # reversible (undo)

    def undo() -> None:
        cls.setup_embeddings_and_output_layer = original
        undo_module()

    return undo


def _patch_param_types() -> Callable[[], None]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    real_type = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """`Tensor.type()` naming a CPU tensor as its CUDA type (`torch.cuda.BFloat16Tensor`); any other call
        is torch's."""
        name = real_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu" or not isinstance(name, str):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    originals = {cls: cls.__init__ for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer)}

    def wrap(init: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            with _LOCK:
                torch.Tensor.type = cuda_named_type  # type: ignore[method-assign,assignment]
                try:
                    init(self, *args, **kwargs)
                finally:
                    torch.Tensor.type = real_type  # type: ignore[method-assign]

        return __init__

    for cls, init in originals.items():
        cls.__init__ = wrap(init)

    def undo() -> None:
        for cls, init in originals.items():
            cls.__init__ = init

    return undo


@dataclass(frozen=True)
class Workaround:
    """One CPU patch: where megatron-core fails without CUDA, and how to apply it."""

    name: str
    failure: str
    """What raises without the patch."""
    apply: Callable[[], Callable[[], None]]
    """Applies the patch; returns the function that reverts it."""


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "rng_tracker",
        "CudaRNGStatesTracker.add/fork call torch.cuda.get_rng_state / the CUDA generators",
        _patch_rng_tracker,
    ),
    Workaround(
        "checkpoint_rng",
        "activation recompute saves/restores the CUDA generator (_get_cuda_rng_state / _set_cuda_rng_state)",
        _patch_checkpoint_rng,
    ),
    Workaround(
        "memory_buffer",
        "GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device()",
        lambda: _shim_module("megatron.core.utils"),
    ),
    Workaround(
        "rotary",
        "RotaryEmbedding moves inv_freq to torch.cuda.current_device()",
        lambda: _shim_module("megatron.core.models.common.embeddings.rotary_pos_embedding"),
    ),
    Workaround(
        "schedules",
        'the forward-backward schedules create total_num_tokens with device="cuda"',
        lambda: _shim_module("megatron.core.pipeline_parallel.schedules"),
    ),
    Workaround(
        "p2p",
        "P2PCommunicator allocates on torch.cuda.current_device() and calls torch.cuda.synchronize()",
        lambda: _shim_module("megatron.core.pipeline_parallel.p2p_communication"),
    ),
    Workaround(
        "ddp_buffers",
        "DistributedDataParallel's _ParamAndGradBuffer allocates on torch.cuda.current_device()",
        lambda: _shim_module("megatron.core.distributed.param_and_grad_buffer"),
    ),
    Workaround(
        "optimizer",
        "FP32Optimizer / MixedPrecisionOptimizer create device='cuda' scalars",
        lambda: _shim_module("megatron.core.optimizer.optimizer"),
    ),
    Workaround(
        "param_types",
        "Float16OptimizerWithFloat16Params and DistributedOptimizer take only torch.cuda.*Tensor parameters "
        "(bf16 / fp16 training's fp32 main parameters)",
        _patch_param_types,
    ),
    Workaround(
        "clip_grads",
        "get_grad_norm_fp32 / count_zeros_fp32 create device='cuda' buffers",
        lambda: _shim_module("megatron.core.optimizer.clip_grads"),
    ),
    Workaround(
        "clip_assert",
        "clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'",
        _patch_clip_assert,
    ),
    Workaround(
        "dist_ckpt",
        "torch_dist saving calls torch.cuda.synchronize() and reduces flags on the CUDA device",
        lambda: _shim_modules(
            "megatron.core.dist_checkpointing.strategies.filesystem_async",
            "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        ),
    ),
    Workaround(
        "moe",
        "the MoE router, its aux-loss tracking and the alltoall dispatcher call torch.cuda.current_device() and "
        "create a torch.cuda.Stream, the expert-parallel gathers allocate on torch.cuda.current_device(); without "
        "transformer_engine the router's GEMM reads an undefined te_general_gemm; the alltoall's split sizes stay "
        "tensors, which all_to_all_single refuses",
        _patch_moe,
    ),
    Workaround(
        "mtp",
        "the MTP loss tracker allocates on torch.cuda.current_device(); with pipeline stages, "
        "LanguageModule.setup_embeddings_and_output_layer calls .cuda() on the embedding weight it all-reduces",
        _patch_mtp,
    ),
    Workaround(
        "sequence_parallel",
        "under sequence parallelism the tensor-parallel linears' backward allocates on torch.cuda.current_device()",
        lambda: _shim_module("megatron.core.tensor_parallel.layers"),
    ),
    Workaround(
        "nvtx",
        "torch.cuda.nvtx.range (upstream's mHC ops) raises 'NVTX functions not installed' on the CPU wheel",
        _patch_nvtx,
    ),
)
_BY_NAME = {w.name: w for w in WORKAROUNDS}
_UNDO: dict[str, Callable[[], None]] = {}
_LOCK = threading.RLock()


def needed() -> bool:
    """True when the workarounds apply: CUDA is not available."""
    return not torch.cuda.is_available()


def _select(names: Iterable[str] | None) -> list[str]:
    if names is None:
        return [w.name for w in WORKAROUNDS]
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown:
        raise ValueError(f"cpu_support: unknown workaround(s) {unknown}; valid: {sorted(_BY_NAME)}")
    return names


def install(names: Iterable[str] | None = None) -> frozenset[str]:
    """Apply the workarounds `names` (default: all) that are not applied yet.

    A no-op when CUDA is available. Returns the names this call applied.
    """
    names = _select(names)
    if not needed():
        return frozenset()
    applied = []
    with _LOCK:
        for name in names:
            if name not in _UNDO:
                _UNDO[name] = _BY_NAME[name].apply()
                applied.append(name)
    return frozenset(applied)


def uninstall(names: Iterable[str] | None = None) -> None:
    """Revert the workarounds `names` (default: all) that are applied, newest first."""
    names = _select(names)
    with _LOCK:
        for name in reversed([n for n in _UNDO if n in names]):
            _UNDO.pop(name)()


def installed() -> frozenset[str]:
    """Names of the workarounds applied now."""
    return frozenset(_UNDO)


@contextlib.contextmanager
def cpu_support(names: Iterable[str] | None = None) -> Iterator[frozenset[str]]:
    """Apply the workarounds for the block; revert on exit only those this block applied."""
    applied = install(names)
    try:
        yield applied
    finally:
        uninstall(applied)
