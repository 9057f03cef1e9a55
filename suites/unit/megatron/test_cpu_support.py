"""`mhc_core.megatron.cpu_support`: every workaround is needed (the megatron-core call fails without
it) and sufficient (the call works with it); install / uninstall are explicit, idempotent, reversible."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402

from mhc_core.megatron import cpu_support  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_world"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is available: the CPU workarounds are no-ops here"
    ),
]
NO_CUDA = (AssertionError, RuntimeError)
"""What torch raises for a CUDA call without a GPU: "Torch not compiled with CUDA enabled" (CPU
build) or "Found no NVIDIA driver" (CUDA build on a CPU machine, as in the compat env)."""


@contextlib.contextmanager
def without(name: str):
    """The workaround `name` reverted for the block (all others unchanged), re-applied after."""
    assert name in cpu_support.installed(), f"{name} should be installed by the megatron_world fixture"
    cpu_support.uninstall([name])
    try:
        yield
    finally:
        cpu_support.install([name])


class TestRngTracker:
    """`rng_tracker`: megatron's RNG tracker keeps named CPU generator states."""

    def test_needed(self):
        """Without it, CudaRNGStatesTracker.add (model_parallel_cuda_manual_seed) asks for the CUDA RNG state."""
        with without("rng_tracker"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            mrandom.CudaRNGStatesTracker().add("mhc-test", 1)

    def test_fork_is_reproducible_and_isolated(self):
        """With it, fork() draws from the named state (same seed, same numbers) and leaves the default CPU stream alone."""
        draws = []
        for _ in range(2):
            tracker = mrandom.CudaRNGStatesTracker()
            tracker.add("mhc-test", 42)
            before = torch.get_rng_state()
            with tracker.fork("mhc-test"):
                first = torch.rand(3)
            with tracker.fork("mhc-test"):
                second = torch.rand(3)
            assert torch.equal(torch.get_rng_state(), before)
            assert not torch.equal(first, second)
            draws.append((first, second))
        assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[1], strict=True))

    def test_model_parallel_seed_works(self):
        """With it, model_parallel_cuda_manual_seed registers the data-, model- and expert-parallel states."""
        mrandom.model_parallel_cuda_manual_seed(1234)
        assert set(mrandom.get_cuda_rng_tracker().get_states()) == {
            mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
            mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        }


class TestCheckpointRng:
    """`checkpoint_rng`: activation recompute saves no CUDA generator state."""

    @staticmethod
    def _checkpointed(x):
        """Dropout (p=0.5) under tensor_parallel.checkpoint: `[k] -> [k]`."""
        return tensor_parallel.checkpoint(
            lambda t: torch.nn.functional.dropout(t, 0.5, training=True), False, x
        )

    def test_needed(self):
        """Without it, tensor_parallel.checkpoint asks for the CUDA RNG state."""
        with without("checkpoint_rng"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._checkpointed(torch.randn(4, requires_grad=True))

    def test_recompute_replays_the_forward_randomness(self):
        """With it, the recompute in backward draws the forward's dropout mask (gradient = 2 * mask)."""
        x = torch.randn(256, requires_grad=True)
        out = self._checkpointed(x)
        out.sum().backward()
        assert torch.equal(x.grad, (out.detach() != 0).float() * 2)


class TestMemoryBuffer:
    """`memory_buffer`: GlobalMemoryBuffer allocates on the CPU."""

    def test_needed(self):
        """Without it, GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device()."""
        with without("memory_buffer"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "mhc-test-needed")

    def test_allocates_on_cpu(self):
        """With it, get_tensor returns a CPU tensor of the asked shape."""
        t = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "mhc-test-works")
        assert t.shape == (2, 3) and t.device.type == "cpu"


class TestRotary:
    """`rotary`: RoPE keeps inv_freq on the CPU."""

    @staticmethod
    def _rope():
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)

    def test_needed(self):
        """Without it, RotaryEmbedding moves inv_freq to torch.cuda.current_device() on the first forward."""
        with without("rotary"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._rope()(4)

    def test_embedding_on_cpu(self):
        """With it, the rotary embedding [s, 1, 1, d] is computed on the CPU."""
        emb = self._rope()(4)
        assert emb.shape == (4, 1, 1, 8) and emb.device.type == "cpu"


SCHEDULES = ["forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving"]


class TestSchedules:
    """`schedules`: the forward-backward schedules count tokens on the CPU."""

    @staticmethod
    def _run(schedule, model, batch):
        from megatron.core.pipeline_parallel import schedules

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        s, b = batch["input_ids"].shape[1], batch["input_ids"].shape[0]
        return getattr(schedules, schedule)(
            forward_step_func=forward_step,
            data_iterator=iter([batch, batch]),
            model=[model],
            num_microbatches=2,
            seq_length=s,
            micro_batch_size=b,
            forward_only=False,
        )

    @pytest.mark.parametrize("schedule", SCHEDULES)
    def test_needed(self, make_config, build_gpt, batch, schedule):
        """Without it, the schedule creates total_num_tokens with device="cuda"."""
        model = build_gpt(make_config(n=2))
        with without("schedules"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._run(schedule, model, batch)

    @pytest.mark.parametrize("schedule", SCHEDULES)
    def test_schedule_runs(self, make_config, build_gpt, batch, schedule):
        """With it, the schedule (the 1F1B one at PP = 1) trains two micro-batches and returns their losses."""
        model = build_gpt(make_config(n=2))
        losses = self._run(schedule, model, batch)
        assert len(losses) == 2 and all(torch.isfinite(d["loss"]) for d in losses)
        assert all(p.grad is not None for p in model.parameters())


class TestP2P:
    """`p2p`: the pipeline communicator allocates on the CPU and does not synchronise CUDA."""

    @staticmethod
    def _communicator():
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        config = ModelParallelConfig(pipeline_dtype=torch.float32, batch_p2p_comm=True, batch_p2p_sync=True)
        return P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)

    @pytest.fixture
    def loopback(self, monkeypatch):
        """gloo cannot send to itself: a batched p2p op that copies what is sent next into the receive-previous buffer."""
        from megatron.core.pipeline_parallel import p2p_communication

        def fake_batched_p2p_ops(*, tensor_send_next, tensor_recv_prev, **_):
            if tensor_recv_prev is not None:
                tensor_recv_prev.data.copy_(tensor_send_next)
            return []

        monkeypatch.setattr(p2p_communication, "_batched_p2p_ops", fake_batched_p2p_ops)

    def test_synchronize_needed(self):
        """Without it, batched p2p ends with torch.cuda.synchronize()."""
        with without("p2p"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._communicator()._communicate(
                tensor_send_next=None,
                tensor_send_prev=None,
                recv_prev=False,
                recv_next=False,
                tensor_shape=(2, 2, 4),
            )

    def test_receive_buffer_needed(self, loopback):
        """Without it, the receive buffer is allocated on torch.cuda.current_device()."""
        with without("p2p"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._communicator()._communicate(
                tensor_send_next=torch.ones(2, 2, 4),
                tensor_send_prev=None,
                recv_prev=True,
                recv_next=False,
                tensor_shape=(2, 2, 4),
            )

    def test_receives_on_cpu(self, loopback):
        """With it, a received tensor [s, b, h] arrives on the CPU."""
        sent = torch.arange(16.0).view(2, 2, 4)
        received, _, _ = self._communicator()._communicate(
            tensor_send_next=sent,
            tensor_send_prev=None,
            recv_prev=True,
            recv_next=False,
            tensor_shape=(2, 2, 4),
        )
        assert received.device.type == "cpu" and torch.equal(received, sent)


def _ddp(config, model, distributed: bool = False):
    """megatron-core's DistributedDataParallel around `model`, as the functional runner builds it (`distributed`:
    for the distributed optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
    )
    return DistributedDataParallel(config, ddp_config, model)


def _optimizer(ddp_model, clip_grad=1.0):
    """get_megatron_optimizer (Adam, fp32; torch's AdamW without TE / apex) that clips at `clip_grad`
    and counts zero grads."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=1e-3, clip_grad=clip_grad, params_dtype=torch.float32, log_num_zeros_in_grad=True
    )
    return get_megatron_optimizer(config, [ddp_model])


def _forward_backward(config, ddp_model, batch):
    """One micro-batch through get_forward_backward_func() with finalize_model_grads (as
    harness/training/trainer.py steps): the gradients land in the DDP grad buffer (`main_grad`)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp_model.no_sync
    ddp_model.zero_grad_buffer()

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    s, b = batch["input_ids"].shape[1], batch["input_ids"].shape[0]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=ddp_model,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=False,
    )


def _main_grads(ddp_model):
    return [p.main_grad for p in ddp_model.parameters()]


@pytest.fixture
def tiny(make_config, build_gpt):
    """A tiny mHC GPT (n = 2) and its config: `(config, model)`."""
    config = make_config(n=2)
    return config, build_gpt(config)


@pytest.fixture
def tiny_ddp(tiny):
    """The tiny GPT wrapped in megatron-core's DDP: `(config, ddp_model)`."""
    config, model = tiny
    return config, _ddp(config, model)


class TestDdpBuffers:
    """`ddp_buffers`: megatron-core's DDP keeps its grad buffer on the CPU."""

    def test_needed(self, tiny):
        """Without it, DistributedDataParallel allocates the grad buffer on torch.cuda.current_device()."""
        with without("ddp_buffers"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            _ddp(*tiny)

    def test_grad_buffer_holds_the_gradients(self, make_config, build_gpt, batch):
        """With it, DDP's CPU grad buffer (main_grad) receives the plain autograd gradients of one micro-batch."""
        config = make_config(n=2)
        ddp_model = _ddp(config, build_gpt(config, seed=0))
        reference = build_gpt(config, seed=0)
        loss = reference(
            batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
        loss.float().mean().backward()
        _forward_backward(config, ddp_model, batch)
        ref = dict(reference.named_parameters())
        for name, param in ddp_model.module.named_parameters():
            assert param.main_grad.device.type == "cpu", name
            torch.testing.assert_close(param.main_grad, ref[name].grad, msg=name)


class TestOptimizer:
    """`optimizer`: megatron-core's optimizer keeps its scalars on the CPU."""

    def test_needed(self, tiny_ddp):
        """Without it, get_megatron_optimizer (FP32Optimizer) creates a device='cuda' scalar."""
        with without("optimizer"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            _optimizer(tiny_ddp[1])

    def test_step_updates_the_parameters(self, tiny_ddp, batch):
        """With it, one step succeeds, reports a finite grad norm and moves every parameter with a non-zero grad."""
        config, ddp_model = tiny_ddp
        optimizer = _optimizer(ddp_model)
        before = [p.detach().clone() for p in ddp_model.parameters()]
        _forward_backward(config, ddp_model, batch)
        moved = [bool(g.any()) for g in _main_grads(ddp_model)]
        ok, grad_norm, _ = optimizer.step()
        assert ok and math.isfinite(grad_norm) and any(moved)
        for p, p0, m in zip(ddp_model.parameters(), before, moved, strict=True):
            assert not m or not torch.equal(p.detach(), p0)


class TestClipGrads:
    """`clip_grads`: the grad norm and the zero count are computed on the CPU."""

    def test_needed(self, tiny_ddp, batch):
        """Without it, optimizer.step() -> get_grad_norm_fp32 creates a device='cuda' buffer."""
        config, ddp_model = tiny_ddp
        optimizer = _optimizer(ddp_model)
        _forward_backward(config, ddp_model, batch)
        with without("clip_grads"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            optimizer.step()

    def test_grad_norm_and_zero_count(self, tiny_ddp, batch):
        """With it, step() reports the L2 norm of all grads and the number of zero grad entries."""
        config, ddp_model = tiny_ddp
        optimizer = _optimizer(ddp_model, clip_grad=1e9)
        _forward_backward(config, ddp_model, batch)
        grads = torch.cat([g.flatten() for g in _main_grads(ddp_model)])
        ok, grad_norm, num_zeros = optimizer.step()
        assert ok
        assert grad_norm == pytest.approx(float(torch.linalg.vector_norm(grads)), rel=1e-5)
        assert num_zeros == int((grads == 0).sum())


class TestClipAssert:
    """`clip_assert`: gradient clipping accepts fp32 grads on the CPU and scales them as megatron-core does."""

    def test_needed(self, tiny_ddp, batch):
        """Without it, optimizer.step() -> clip_grad_by_total_norm_fp32 asserts torch.cuda.FloatTensor grads."""
        config, ddp_model = tiny_ddp
        optimizer = _optimizer(ddp_model)
        _forward_backward(config, ddp_model, batch)
        with without("clip_assert"), pytest.raises(AssertionError) as failure:
            optimizer.step()
        assert "torch.cuda.FloatTensor" in str(failure.traceback[-1].statement)

    def test_step_clips_to_max_norm(self, tiny_ddp, batch):
        """With it, a step with clip_grad below the grad norm leaves grads of total norm clip_grad."""
        config, ddp_model = tiny_ddp
        optimizer = _optimizer(ddp_model, clip_grad=1e-3)
        _forward_backward(config, ddp_model, batch)
        ok, grad_norm, _ = optimizer.step()
        clipped = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _main_grads(ddp_model)]))
        assert ok and grad_norm > 1e-2
        assert float(clipped) == pytest.approx(1e-3, rel=1e-4)

    @pytest.mark.parametrize(("max_norm", "norm_as_tensor"), [(0.5, False), (100.0, False), (0.5, True)])
    def test_scales_like_torch_clip_grad_norm(self, max_norm, norm_as_tensor):
        """The patched function scales by max_norm / (total_norm + 1e-6) when below 1, as
        torch.nn.utils.clip_grad_norm_ does (clipping at 0.5, untouched at 100; a tensor total_norm,
        as newer megatron-core passes, is clamped the same way)."""
        from megatron.core.optimizer import optimizer as moptimizer

        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(3)]
        for p in params:
            p.grad = torch.randn(5, 3, generator=g)
        expected = [p.grad.clone() for p in params]
        reference = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in params]
        for r, e in zip(reference, expected, strict=True):
            r.grad = e.clone()
        total_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)
        total_norm = total_norm if norm_as_tensor else float(total_norm)
        moptimizer.clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
        for p, r in zip(params, reference, strict=True):
            torch.testing.assert_close(p.grad, r.grad)


DIST_CKPT_MODULES = [
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
]


class TestDistCkpt:
    """`dist_ckpt`: torch_dist checkpoint saving does not synchronise CUDA or reduce on a CUDA device."""

    @staticmethod
    def _save(model, path):
        from megatron.core import dist_checkpointing

        path.mkdir()
        dist_checkpointing.save(model.sharded_state_dict(), str(path))

    def test_needed(self, tiny, tmp_path):
        """Without it, dist_checkpointing.save (torch_dist) calls torch.cuda.synchronize()."""
        with without("dist_ckpt"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._save(tiny[1], tmp_path / "ckpt")

    @pytest.mark.parametrize("module", DIST_CKPT_MODULES, ids=lambda m: m.rsplit(".", 1)[1])
    def test_each_module_needed(self, tiny, tmp_path, monkeypatch, module):
        """Both shims are needed: with either module on the real torch, saving still fails."""
        import importlib

        monkeypatch.setattr(importlib.import_module(module), "torch", torch)
        with pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            self._save(tiny[1], tmp_path / "ckpt")

    def test_save_and_load_round_trip(self, make_config, build_gpt, tmp_path):
        """With it, a saved model loads back (dist_checkpointing.load) into a differently initialised one."""
        from megatron.core import dist_checkpointing

        config = make_config(n=2)
        saved, restored = build_gpt(config, seed=0), build_gpt(config, seed=1)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():  # constant-initialised tensors (alphas, biases, norms) must differ too
            for p in saved.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        before = restored.state_dict()
        differ = [
            k
            for k, v in saved.state_dict().items()
            if isinstance(v, torch.Tensor) and not torch.equal(v, before[k])
        ]
        assert any("hyper_connection" in k and k.endswith("alpha_res") for k in differ), differ
        self._save(saved, tmp_path / "ckpt")
        restored.load_state_dict(
            dist_checkpointing.load(restored.sharded_state_dict(), str(tmp_path / "ckpt"))
        )
        expected = saved.state_dict()
        for name, value in restored.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, expected[name]), name
        assert len(differ) == sum(
            isinstance(v, torch.Tensor) and v.is_floating_point() for v in expected.values()
        ), "every parameter was perturbed, so every one had to be restored by the load"


class TestNvtx:
    """`nvtx`: profiling ranges (upstream's mHC ops open them) are no-ops on a torch without NVTX."""

    @staticmethod
    def _has_nvtx() -> bool:
        import torch.cuda.nvtx as nvtx

        with without("nvtx"):
            return type(nvtx._nvtx).__name__ != "_NVTXStub"

    def test_needed(self):
        """Without it, torch.cuda.nvtx.range raises on torch's CPU wheel."""
        if self._has_nvtx():
            pytest.skip("this torch has NVTX (a CUDA build): its ranges work without a GPU, nothing to shim")
        with without("nvtx"), pytest.raises(RuntimeError, match="NVTX functions not installed"):
            with torch.cuda.nvtx.range("mhc-test"):
                pass

    def test_ranges_and_marks_run(self):
        """With it, range / range_push / range_pop / mark / start / end all run and push reports a depth."""
        with torch.cuda.nvtx.range("mhc-test"):
            depth = torch.cuda.nvtx.range_push("inner")
            torch.cuda.nvtx.mark("m")
            torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_end(torch.cuda.nvtx.range_start("r"))
        assert isinstance(depth, int)

    def test_torch_with_nvtx_is_left_alone(self, monkeypatch):
        """Where torch has NVTX, the workaround replaces nothing (and its undo restores nothing)."""
        import torch.cuda.nvtx as nvtx

        with without("nvtx"), monkeypatch.context() as m:  # the stub is back before `without` re-installs
            real = object()
            m.setattr(nvtx, "_nvtx", real)
            with cpu_support.cpu_support(["nvtx"]) as applied:
                assert applied == {"nvtx"} and nvtx._nvtx is real
            assert nvtx._nvtx is real


class TestInstall:
    """install / uninstall / cpu_support(): explicit, idempotent, reversible."""

    def test_all_workarounds_installed_by_the_fixture(self):
        """The session fixture applied every workaround (the names are the documented ones)."""
        assert cpu_support.installed() == {w.name for w in cpu_support.WORKAROUNDS}

    def test_install_is_idempotent(self):
        """A second install applies nothing and changes nothing."""
        from megatron.core import utils

        shim = utils.torch
        assert cpu_support.install() == frozenset()
        assert utils.torch is shim

    def test_uninstall_restores_the_originals(self):
        """uninstall puts back the very objects it replaced; install applies them again."""
        from megatron.core import utils

        with without("memory_buffer"), without("rng_tracker"):
            assert utils.torch is torch
            assert mrandom.CudaRNGStatesTracker.add.__module__ == mrandom.__name__
        assert utils.torch is not torch

    def test_uninstall_restores_a_function_and_several_modules(self):
        """clip_assert puts back megatron-core's clip function; dist_ckpt restores both of its modules."""
        import importlib

        from megatron.core.optimizer import clip_grads
        from megatron.core.optimizer import optimizer as moptimizer

        modules = [importlib.import_module(m) for m in DIST_CKPT_MODULES]
        with without("clip_assert"), without("dist_ckpt"):
            assert moptimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
            assert all(m.torch is torch for m in modules)
        assert moptimizer.clip_grad_by_total_norm_fp32 is not clip_grads.clip_grad_by_total_norm_fp32
        assert all(m.torch is not torch for m in modules)

    def test_context_manager_reverts_only_what_it_applied(self):
        """cpu_support() inside an installed session applies nothing, so it reverts nothing on exit."""
        with cpu_support.cpu_support() as applied:
            assert applied == frozenset()
        assert cpu_support.installed() == {w.name for w in cpu_support.WORKAROUNDS}

    def test_context_manager_applies_and_reverts(self):
        """cpu_support(['rotary']) with 'rotary' reverted applies it for the block and reverts it after."""
        from megatron.core.models.common.embeddings import rotary_pos_embedding

        with without("rotary"):
            with cpu_support.cpu_support(["rotary"]) as applied:
                assert applied == {"rotary"} and rotary_pos_embedding.torch is not torch
            assert rotary_pos_embedding.torch is torch

    def test_no_op_with_cuda(self, monkeypatch):
        """Where CUDA is available, install() applies nothing."""
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with without("p2p"):
            assert cpu_support.install(["p2p"]) == frozenset()
            assert "p2p" not in cpu_support.installed()

    def test_unknown_name_raises(self):
        """An unknown workaround name is a ValueError listing the valid ones."""
        with pytest.raises(ValueError, match="unknown workaround.*'nccl'.*valid"):
            cpu_support.install(["nccl"])

    @pytest.mark.slow
    def test_import_has_no_side_effect(self):
        """Importing mhc_core.megatron patches nothing in megatron-core (checked in a fresh interpreter)."""
        code = (
            "import torch, mhc_core.megatron as m\n"
            "from megatron.core import utils\n"
            "from megatron.core.pipeline_parallel import schedules\n"
            "from megatron.core.tensor_parallel import random as r\n"
            "from megatron.core.optimizer import clip_grads, optimizer as o\n"
            "assert not m.cpu_support.installed()\n"
            "assert utils.torch is torch and schedules.torch is torch and o.torch is torch\n"
            "assert o.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32\n"
            "assert r.CudaRNGStatesTracker.add.__module__ == r.__name__\n"
        )
        result = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]


MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, ffn_hidden_size=64, add_bias_linear=False
)


class TestMoe:
    """`moe`: megatron-core's MoE layer (router, aux-loss tracker, token dispatchers) runs on the CPU."""

    def test_router_needed(self, make_config, build_gpt, batch):
        """Without it, the router's gating asks torch.cuda for the current device (or, on 0.16.1 without
        transformer_engine, reads an undefined te_general_gemm) on the first forward."""
        model = build_gpt(make_config(**MOE, moe_token_dispatcher_type="allgather"))
        with without("moe"), pytest.raises((*NO_CUDA, NameError), match="CUDA|NVIDIA driver|te_general_gemm"):
            model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])

    def test_alltoall_dispatcher_needed(self, make_config, build_gpt):
        """Without it, building an alltoall dispatcher creates a torch.cuda.Stream (megatron-core 0.16.1; 0.19 makes
        it lazily, and then the router call above still fails)."""
        from megatron.core.transformer.moe import token_dispatcher

        if not hasattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream"):
            pytest.skip("this megatron-core creates the alltoall dispatcher's stream lazily")
        saved = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # as before the first dispatcher
        try:
            with without("moe"), pytest.raises(NO_CUDA, match="CUDA"):
                build_gpt(make_config(**MOE, moe_token_dispatcher_type="alltoall"))
        finally:
            token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved

    @pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
    def test_moe_gpt_trains(self, make_config, build_gpt, batch, dispatcher):
        """With it, forward and backward run and the tracked load-balancing loss is finite and positive."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        clear_aux_losses_tracker()
        model = build_gpt(make_config(**MOE, moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher))
        out = model(
            batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
        out.mean().backward()
        assert model.decoder.layers[0].mlp.router.weight.grad.abs().max() > 0
        tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
        assert torch.isfinite(tracked).all() and bool((tracked > 0).all()), tracked


class TestMtp:
    """`mtp`: megatron-core's multi-token prediction runs on the CPU (its loss tracker; the `.cuda()` of the
    embedding weight the MTP stage ties under pipeline stages is run by the pp suite's MTP cases)."""

    def test_tracker_needed(self, make_config, build_gpt, batch):
        """Without it, the first MTP loss the model tracks asks torch.cuda for the current device."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        model = build_gpt(make_config(mtp_num_layers=1))
        MTPLossLoggingHelper.tracker.clear()
        with without("mtp"), pytest.raises(NO_CUDA, match="CUDA|NVIDIA driver"):
            model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
