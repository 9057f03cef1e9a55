"""cuTile's own launch path without a GPU, up to its compile cache: does a JIT launch find a key?

`build_stub(dir)` compiles a stand-in `libcuda.so.1` (the CUDA driver entry points cuTile asks for,
answering as one sm_90 device, launching nothing). Run as a script in a process whose
`LD_LIBRARY_PATH` holds that directory, this module runs the real launch wrappers on CPU tensors
through `cuda.tile.launch` (tensors passed by DLPack, marked as CUDA memory), with tileiras
replaced by a counter: every launch that does not find its kernel in `CUDA_TILE_CACHE_DIR` is a
miss. Then it replays the same plan once more, counting the JIT's compiles (`compile_tile`, what a
launch calls when the kernel's in-memory cache has no entry for its arguments) in that second round:
a kernel that re-specialises per call would pay a compile or a cache lookup on every GPU call. It
prints `{"launches", "misses", "errors", "compiles", "recompiles"}` as JSON (`launches` and `compiles`:
of the first round).

    python -m suites.unit.kernels_cutile.stub_driver N T C [bf16|fp32]
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

STUB_C = r"""
#include <stdlib.h>
#include <string.h>
static int ok(void) { return 0; }
static int driver_version(int *v) { *v = 13000; return 0; }
static int device_count(int *c) { *c = 1; return 0; }
static int device_get(int *d, int ordinal) { *d = 0; return 0; }
static int ctx_device(int *d) { *d = 0; return 0; }
static int device_attribute(int *v, int attrib, int dev) {
    switch (attrib) {
    case 75: *v = 9; break;                      /* compute capability major */
    case 76: *v = 0; break;                      /* minor */
    case 16: *v = 132; break;                    /* SMs */
    case 1: *v = 1024; break;                    /* threads per block */
    case 2: case 3: case 4: case 5: case 6: case 7: *v = 65535; break;  /* block / grid dims */
    default: *v = 0;
    }
    return 0;
}
static int pointer_attribute(void *data, int attrib, unsigned long long ptr) {
    memset(data, 0, 8);
    if (attrib == 2) *(int *)data = 2;           /* memory type: device */
    if (attrib == 1) *(void **)data = (void *)0x1000;  /* context */
    return 0;
}
int cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags, int *status) {
    if (!strcmp(symbol, "cuDriverGetVersion")) *fn = (void *)driver_version;
    else if (!strcmp(symbol, "cuDeviceGetCount")) *fn = (void *)device_count;
    else if (!strcmp(symbol, "cuDeviceGet")) *fn = (void *)device_get;
    else if (!strcmp(symbol, "cuCtxGetDevice")) *fn = (void *)ctx_device;
    else if (!strcmp(symbol, "cuDeviceGetAttribute")) *fn = (void *)device_attribute;
    else if (!strcmp(symbol, "cuPointerGetAttribute")) *fn = (void *)pointer_attribute;
    else *fn = (void *)ok;
    if (status) *status = 0;
    return 0;
}
"""


def build_stub(directory: Path) -> Path | None:
    """`directory/libcuda.so.1` built from `STUB_C` with the C compiler on PATH (None: there is none)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = directory / "stub.c"
    src.write_text(STUB_C)
    lib = directory / "libcuda.so.1"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True, timeout=60
    )
    return lib


class _CudaView:
    """A CPU tensor offered by DLPack as CUDA memory (its address is never dereferenced here)."""

    def __init__(self, t) -> None:
        self.t = t.detach()

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, stream=None, **kwargs):
        cap = self.t.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        ctypes.c_int32.from_address(get(cap, b"dltensor") + 8).value = 2  # DLTensor.device.device_type
        return cap


def main(argv: list[str]) -> int:
    import cuda.tile as ct
    import cuda.tile._compile as compile_mod
    import torch

    from tools.cutile import signatures
    from tools.cutile.recording import RecordingRuntime

    misses: list[str] = []

    def no_tileiras(path, *args, **kwargs):  # what a cache miss calls
        misses.append(Path(path).name)
        raise RuntimeError("cache miss: tileiras called")

    compile_mod.compile_cubin = no_tileiras
    compiles: list[str] = []
    compile_tile = compile_mod.compile_tile

    def counted_compile_tile(*args, **kwargs):  # cuTile imports it at each call: the patch is seen
        compiles.append("compile")
        return compile_tile(*args, **kwargs)

    compile_mod.compile_tile = counted_compile_tile

    class StubGpuRuntime(RecordingRuntime):
        """Records like the signature plan, and launches each kernel through `cuda.tile.launch`."""

        def __init__(self) -> None:
            super().__init__()
            self.errors: list[str] = []

        def launch(self, grid, kernel_name, args) -> None:
            super().launch(grid, kernel_name, args)
            kernel = signatures.kernel_object(kernel_name)
            try:
                ct.launch(
                    0, grid, kernel, tuple(_CudaView(a) if isinstance(a, torch.Tensor) else a for a in args)
                )
            except Exception as exc:
                self.errors.append(f"{self.label} {kernel_name}: {type(exc).__name__}: {exc}"[:300])

    from mhc_core.variants import Variant

    n, t, c = (int(v) for v in argv[:3])
    act = argv[3] if len(argv) > 3 else "both"
    acts = (
        (torch.bfloat16,)
        if act == "bf16"
        else (torch.float32,)
        if act == "fp32"
        else (torch.bfloat16, torch.float32)
    )
    variants = tuple(Variant(v) for v in argv[4:]) or tuple(Variant)
    rt = StubGpuRuntime()
    signatures.record_all(rt, (n,), t, (c,), acts, variants)
    first_round, first_compiles = len(rt.launches), len(compiles)
    signatures.record_all(
        rt, (n,), t, (c,), acts, variants
    )  # new tensors, the same kinds: no compile expected
    print(
        json.dumps(
            {
                "launches": first_round,
                "misses": len(misses),
                "errors": rt.errors[:20],
                "compiles": first_compiles,
                "recompiles": len(compiles) - first_compiles,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
