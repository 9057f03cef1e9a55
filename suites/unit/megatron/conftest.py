"""Fixtures of the megatron-core unit tests: one single-process gloo world, tiny fp32 GPT configs.

Legend: s sequence, b micro-batch, C hidden size, n residual streams, V vocabulary.
megatron-core is imported lazily (inside fixtures), so this file loads without it; every test
module skips itself with `pytest.importorskip("megatron.core")`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

SEQ, BATCH, HIDDEN, HEADS, VOCAB, LAYERS = 8, 2, 32, 4, 64, 2
"""s, b, C, attention heads, V, layers of every tiny model."""
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Models are initialised on the CPU (`use_cpu_initialization`) and moved here, as megatron's
`get_model` does; inputs are created here."""


@pytest.fixture
def device() -> torch.device:
    """Where models and inputs live: CUDA when available, else the CPU."""
    return DEVICE


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """torch.distributed (world size 1, file:// rendezvous: gloo, plus NCCL for CUDA tensors on a GPU
    machine, where megatron's DDP all-reduces CUDA grad buffers and gloo has no coalesced CUDA
    all-reduce), megatron-core's model-parallel state (TP = PP = 1) and RNG tracker; the CPU
    workarounds are installed while CUDA is absent.

    Module scope: everything is torn down after each test module, so suites that run later in the
    same process (and assert that no process group exists) see a clean slate."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mhc_core.megatron import cpu_support

    owns_pg = not dist.is_initialized()
    if owns_pg:
        store = tmp_path_factory.mktemp("gloo") / "rendezvous"
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    applied = cpu_support.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        cpu_support.uninstall(applied)
        if owns_pg:
            dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_loss_trackers() -> Iterator[None]:
    """megatron-core's MoE and MTP loss trackers are module globals sized by the first model that fills them: each
    test starts with them empty, so one test's model (4 MoE layers) never shapes another's tracked losses."""
    import sys

    def clear() -> None:
        moe_logging = sys.modules.get(
            "megatron.core.transformer.moe.moe_logging"
        )  # megatron-core >= 0.16's home
        if moe_logging is not None and hasattr(moe_logging, "get_moe_metrics_tracker"):
            moe_logging.get_moe_metrics_tracker().metrics.clear()
        moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
        if moe_utils is not None and not hasattr(moe_logging, "get_moe_metrics_tracker"):
            moe_utils.get_moe_layer_wise_logging_tracker().clear()  # the tracker dict itself (0.16.1)
        mtp = sys.modules.get("megatron.core.transformer.multi_token_prediction")
        if mtp is not None:
            mtp.MTPLossLoggingHelper.tracker.clear()

    clear()
    yield
    clear()


@pytest.fixture
def make_config() -> Callable[..., Any]:
    """`make_config(n=None, **overrides)`: a 2-layer, C=32, 4-head fp32 `MHCTransformerConfig` on CPU
    with dropout 0; mHC on with n streams when `n` is given."""
    from mhc_core.megatron import MHCTransformerConfig

    def make(n: int | None = None, **overrides: Any) -> Any:
        kwargs: dict[str, Any] = dict(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
        )
        if n is not None:
            kwargs.update(enable_mhc_connections=True, mhc_num_residual_streams=n)
        kwargs.update(overrides)
        return MHCTransformerConfig(**kwargs)

    return make


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    """input_ids / labels `[b, s]`, position_ids `[b, s]`, causal attention_mask `[1, 1, s, s]`."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
        "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    }
    return {k: v.to(DEVICE) for k, v in tensors.items()}


@pytest.fixture
def build_gpt() -> Callable[..., Any]:
    """`build_gpt(config, seed=0, **kwargs)`: `mhc_core.megatron.build_gpt_model` (V=64, max s=16)
    under a fixed CPU seed, which megatron's CPU initialisation draws from, moved to `DEVICE`."""
    from mhc_core.megatron import build_gpt_model

    def build(config: Any, seed: int = 0, **kwargs: Any) -> Any:
        torch.manual_seed(seed)
        return build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=2 * SEQ, **kwargs).to(DEVICE)

    return build


def logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[b, s, V]` logits of a GPT model (no labels)."""
    return model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])


@pytest.fixture
def gpt_logits() -> Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]:
    """`gpt_logits(model, batch)`: the model's `[b, s, V]` logits."""
    return logits


@pytest.fixture
def dims() -> Any:
    """The tiny-model sizes: `s, b, c, heads, v, layers`."""
    from types import SimpleNamespace

    return SimpleNamespace(s=SEQ, b=BATCH, c=HIDDEN, heads=HEADS, v=VOCAB, layers=LAYERS)


@pytest.fixture
def recompute_states(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Weak references to the storage of every n-stream state an mHC recompute group produces
    (`StreamRecompute.post_residual_bda`), in order: `not ref.expired()` after forward means the state is kept."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from mhc_core.recompute import StreamRecompute

    made: list[Any] = []
    original = StreamRecompute.post_residual_bda

    def recording(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(self, *args, **kwargs)
        made.append(StorageWeakRef(out.untyped_storage()))
        return out

    monkeypatch.setattr(StreamRecompute, "post_residual_bda", recording)
    return made
