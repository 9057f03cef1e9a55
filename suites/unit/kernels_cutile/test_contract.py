"""The contract the dispatch relies on: import without cuda.tile, availability, clear refusals."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

import mhc_core.kernels.cutile as cutile
from mhc_core import ops as ref
from mhc_core.kernels.cutile import CuTileBackend, toolchain
from mhc_core.kernels.cutile.runtime import CuTileRuntime
from mhc_core.kernels.dispatch import bound_ops
from tools.cutile.emulator import EmulatedRuntime


def _has_cuda_tile() -> bool:
    try:
        return importlib.util.find_spec("cuda.tile") is not None
    except ImportError:
        return False


def test_availability_is_a_bool_and_a_reason():
    """availability() returns (bool, non-empty str) on any machine."""
    ok, why = cutile.availability()
    assert isinstance(ok, bool) and isinstance(why, str) and why


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_unavailable_without_gpu_names_the_gpu():
    """Without a GPU, availability() is False and says so."""
    ok, why = cutile.availability()
    assert not ok and "GPU" in why


@pytest.mark.skipif(_has_cuda_tile(), reason="cuda.tile is installed")
def test_import_works_without_cuda_tile():
    """The package imports and reports the missing cuda.tile instead of failing."""
    ok, why = cutile.availability()
    assert not ok and "cuda.tile" in why


@pytest.mark.parametrize("name", ["sinkhorn", "mapping", "h_aggregate", "h_post_bda", "pre"])
def test_each_op_takes_the_checked_call(name):
    """Each op of the backend takes its op's call and nothing else (the contract: `mhc_core.ops.contract`), so
    the arguments, their defaults and their checks are the reference entry's."""
    params = list(inspect.signature(getattr(CuTileBackend, name)).parameters)
    assert params == ["self", "call"], params
    entry = inspect.signature(getattr(ref, name)).parameters
    assert "backend" in entry and entry["backend"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.fixture(scope="module")
def emu():
    return bound_ops(CuTileBackend(EmulatedRuntime()))


def test_unsupported_n_is_not_implemented(emu):
    """n = 3 has no kernel: NotImplementedError naming n."""
    with pytest.raises(NotImplementedError, match="n=3"):
        emu.sinkhorn(torch.zeros(2, 3, 3), 2)
    with pytest.raises(NotImplementedError, match="n=3"):
        emu.h_aggregate(torch.zeros(2, 3, 8), torch.zeros(2, 3))


def test_fp64_is_not_implemented(emu):
    """fp64 inputs: NotImplementedError naming the dtype."""
    with pytest.raises(NotImplementedError, match="float64"):
        emu.h_aggregate(torch.zeros(2, 4, 8, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))


def test_sinkhorn_in_the_input_dtype_is_not_implemented(emu):
    """`input_dtype_sinkhorn`: no kernel iterates in bf16; NotImplementedError naming the option (auto then runs
    the next backend)."""
    with pytest.raises(NotImplementedError, match="input_dtype_sinkhorn"):
        emu.sinkhorn(
            torch.zeros(2, 4, 4, dtype=torch.bfloat16), 2, None, "megatron_main+input_dtype_sinkhorn"
        )


def test_dropout_in_training_is_not_implemented(emu):
    """dropout_p > 0 while training: NotImplementedError naming dropout."""
    t, n, c = 2, 4, 8
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        emu.h_post_bda(
            torch.zeros(t, n, n),
            torch.zeros(t, n, c),
            torch.zeros(t, n),
            torch.zeros(t, c),
            None,
            0.1,
            True,
            "megatron_main",
        )


def test_bad_shapes_raise_the_reference_value_error(emu):
    """Shape errors are the reference's ValueError, before any coverage check."""
    with pytest.raises(ValueError, match="h_pre"):
        emu.h_aggregate(torch.zeros(2, 4, 8), torch.zeros(3, 4))


def test_cpu_tensors_are_not_implemented_on_the_gpu_runtime():
    """The GPU runtime refuses CPU tensors with NotImplementedError naming the device."""
    with pytest.raises(NotImplementedError, match="cpu"):
        CuTileRuntime.check_tensor(torch.zeros(1), "x", "h_aggregate")


@pytest.mark.skipif(cutile.availability()[0], reason="the cuTile backend is available here")
def test_forced_call_without_backend_is_an_error():
    """Calling an op where the backend is unavailable raises RuntimeError with the reason."""
    with pytest.raises(RuntimeError, match="cutile backend unavailable"):
        ref.h_aggregate(torch.zeros(2, 4, 8), torch.zeros(2, 4), backend=cutile.CUTILE)


def test_toolchain_env_puts_its_bin_first(tmp_path):
    """Toolchain.env() prepends bin to PATH, sets CUDA_HOME and the libnvvm directory."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    tc = toolchain.Toolchain(
        tileiras=tmp_path / "bin" / "tileiras",
        ptxas=None,
        libnvvm=tmp_path / "lib" / "libnvvm.so.4",
        cuda_home=tmp_path,
        source="test",
    )
    env = tc.env({"PATH": "/usr/bin"})
    assert env["PATH"].split(":")[0] == str(tmp_path / "bin")
    assert env["CUDA_HOME"] == str(tmp_path)
    assert env["LD_LIBRARY_PATH"] == str(tmp_path / "lib")


@pytest.mark.parametrize(
    ("version", "release", "hopper"),
    [
        ("13.4.92", (13, 4), True),
        ("13.10.1", (13, 10), True),
        ("13.2.1", (13, 2), False),
        ("unknown", (0,), False),
    ],
)
def test_toolchain_release_compares_as_numbers(tmp_path, version, release, hopper):
    """`Toolchain.release` is `(major, minor)` of the tileiras version, compared as numbers (sm_90 needs
    >= 13.3, `HOPPER_MIN_TILEIRAS`); a version that cannot be read counts as too old."""
    from mhc_core.kernels.cutile import HOPPER_MIN_TILEIRAS

    tc = toolchain.Toolchain(
        tileiras=tmp_path / "tileiras", ptxas=None, libnvvm=None, cuda_home=None, source="test"
    )
    tc.__dict__["version"] = version  # what the cached `tileiras --version` parse returned
    assert tc.release == release
    assert (tc.release >= HOPPER_MIN_TILEIRAS) is hopper


@pytest.mark.skipif(
    not _has_cuda_tile(), reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')"
)
def test_occupancy_hint_reaches_the_kernel_object():
    """Inside `tiling.overridden(occupancy=...)` the GPU runtime launches a hinted copy (kept), outside the plain kernel."""
    from mhc_core.kernels.cutile import tiling

    rt = CuTileRuntime()  # builds kernel objects only: no GPU needed
    with tiling.tuned(None):  # on a GPU, the device's shipped tuning may be in force
        plain = rt._kernel("h_aggregate_fwd_kernel")
        with tiling.overridden(occupancy={"h_aggregate_fwd_kernel": 4}):
            hinted = rt._kernel("h_aggregate_fwd_kernel")
            assert hinted is rt._kernel("h_aggregate_fwd_kernel")
        assert hinted._compiler_options.occupancy == 4
        assert plain._compiler_options.occupancy is None
        assert rt._kernel("h_aggregate_fwd_kernel") is plain


@pytest.mark.skipif(
    not _has_cuda_tile(), reason="cuda.tile is not installed (pip install 'cuda-tile[tileiras]==1.7.0')"
)
def test_default_occupancy_reaches_runtime_and_offline_compile(monkeypatch):
    """A hint in `tiling.DEFAULT_OCCUPANCY` is what the runtime launches and CI compiles; an override replaces it."""
    from mhc_core.kernels.cutile import tiling
    from tools.cutile.signatures import kernel_object

    monkeypatch.setitem(tiling.DEFAULT_OCCUPANCY, "h_post_bda_bwd_kernel", 4)
    monkeypatch.setattr(tiling, "_TUNING", None)  # on a GPU, the device's shipped tuning may be in force
    rt = CuTileRuntime()
    assert rt._kernel("h_post_bda_bwd_kernel")._compiler_options.occupancy == 4
    assert kernel_object("h_post_bda_bwd_kernel")._compiler_options.occupancy == 4
    assert kernel_object("h_post_bda_fwd_kernel")._compiler_options.occupancy is None
    with tiling.overridden(occupancy={"h_post_bda_fwd_kernel": 2}):
        assert tiling.occupancy("h_post_bda_bwd_kernel") is None  # the override names the hints in force
        assert kernel_object("h_post_bda_fwd_kernel")._compiler_options.occupancy == 2


def test_numpy_integers_reach_the_kernels_as_python_ints():
    """n / iterations given as NumPy integers launch exactly what Python ints launch, every constant a Python
    scalar (cuTile's launch and its JIT keys take int / float / bool, not NumPy scalars)."""
    import numpy as np

    from tools.cutile.recording import ConstArg, RecordingRuntime

    def record(as_int):
        rt = RecordingRuntime()
        ops = bound_ops(CuTileBackend(rt))
        t, n, c = 4, 4, 16
        x = torch.randn(t, n * c, requires_grad=True)
        outs = ops.mapping(
            x,
            torch.randn(n * n + 2 * n, n * c),
            torch.ones(1),
            torch.ones(1),
            torch.ones(1),
            torch.zeros(n * n + 2 * n),
            as_int(n),
        )
        logits = torch.randn(t, n, n, requires_grad=True)
        outs = (*outs, ops.sinkhorn(logits, as_int(5)))
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return rt.launches

    want, got = record(int), record(np.int64)
    assert got == want and len(want) >= 4
    consts = [a.value for launch in got for a in launch.args if isinstance(a, ConstArg)]
    assert consts and all(type(v) in (int, float, bool) for v in consts), sorted(
        {type(v).__name__ for v in consts}
    )
