"""The few places where megatron-core versions (0.16.1 CI, 0.19.2 latest) need care, in one module.

- `megatron_core_version()`: the installed version as a tuple.
- `gpt_model_classes(**classes)`: `GPTModel.__init__` builds its decoder and its MTP block by the
  module-global names `TransformerBlock` and `MultiTokenPredictionBlock` of
  `megatron.core.models.gpt.gpt_model` in both versions (it takes no class arguments, and 0.19.2 adds
  constructor keywords such as `use_fused_lce`). Binding those names to subclasses for the duration of
  one constructor call lets `MHCGPTModel` build each once, with exactly the arguments the installed
  version passes.
- `transformer_engine_available()`: TE specs need `transformer_engine`, which never installs on CPU.
- `checkpoint_without_output(config)`: megatron-core 0.16.1's `CheckpointWithoutOutput(fp8=False)`
  default reads as "fp8 on" (`self.fp8 = fp8 is not None`) and then needs TE; the real setting
  (`config.fp8`, None when off) is passed where the constructor takes it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "checkpoint_without_output",
    "gpt_model_classes",
    "megatron_core_version",
    "transformer_engine_available",
]

_GPT_MODEL_MODULE = "megatron.core.models.gpt.gpt_model"
_LOCK = threading.RLock()


def megatron_core_version() -> tuple[int, int, int]:
    """`(major, minor, patch)` of the installed megatron-core."""
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def transformer_engine_available() -> bool:
    """True when `transformer_engine` (and megatron-core's TE extension) can be imported."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        from megatron.core.extensions import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def gpt_model_classes(**classes: type) -> Iterator[None]:
    """Within the block, `GPTModel.__init__` builds with `classes` (name -> a subclass of the stock class).

    `gpt_model_classes(TransformerBlock=MyBlock)` binds the module-global name `TransformerBlock` of
    `megatron.core.models.gpt.gpt_model` to `MyBlock`. Restores the previous bindings on exit, also on
    error. Serialised with a lock, so two threads constructing models never see each other's binding.
    """
    gpt_model: Any = importlib.import_module(_GPT_MODEL_MODULE)
    with _LOCK:
        previous: dict[str, type] = {}
        for name, cls in classes.items():
            if not hasattr(gpt_model, name):
                raise RuntimeError(
                    f"{_GPT_MODEL_MODULE} has no name {name!r} in megatron-core "
                    f"{'.'.join(map(str, megatron_core_version()))}: mhc_core.megatron.compat needs updating"
                )
            stock = getattr(gpt_model, name)
            if not issubclass(cls, stock):
                raise TypeError(f"gpt_model_classes: {cls.__name__} must subclass {stock.__name__}")
            previous[name] = stock
        try:
            for name, cls in classes.items():
                setattr(gpt_model, name, cls)
            yield
        finally:
            for name, stock in previous.items():
                setattr(gpt_model, name, stock)


def checkpoint_without_output(config: Any) -> Any:
    """A `tensor_parallel.CheckpointWithoutOutput` told the real fp8 setting of `config`."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput

    if "fp8" in inspect.signature(CheckpointWithoutOutput).parameters:
        return CheckpointWithoutOutput(fp8=getattr(config, "fp8", None))
    return CheckpointWithoutOutput()
