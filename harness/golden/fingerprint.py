"""The numerics fingerprint: what decides the bits of a run's results on this machine.

A hardware key (`harness.golden.hardware`) groups machines; two machines under one key can still sum
in another order: another CPU model's BLAS / oneDNN blocking, another vector ISA, another thread
count, another GPU driver or kernel library. `NumericsFingerprint` records those facts, and
its `id` (a digest of them) names the set of machines whose runs are
expected to agree bit for bit. Exact golden values are kept per fingerprint (`harness.golden.store`).

Fields, and why each is in:

* `device` `cpu` or `cuda`; `cpu_vendor`, `cpu_model` (name, family / model / stepping)
  and `cpu_isa` (the vector extensions the CPU has): MKL and oneDNN choose kernels and blockings
  by CPU, so two x86-64 models differ even under the same pins;
* `cpu_capability`: the ISA torch's own kernels dispatch to (`torch.backends.cpu.
  get_cpu_capability()`, after `ATEN_CPU_CAPABILITY`);
* `blas`, `onednn`: the BLAS and oneDNN builds torch carries;
* `pins`: the environment variables in force that move code paths (ISA caps, CBWR, TF32, cuBLAS
  workspace, NCCL algorithm);
* `threads`: `torch.get_num_threads()`; `torch`, `megatron_core`: versions;
* on a GPU: `gpu` (name and count), `driver`, `cuda`, `cudnn` and `kernel_libs` (the
  versions of cuda-tile, transformer-engine, triton, tile-kernels where installed).

`current_fingerprint` reads it from the running process (importing torch where it is
installed); a process that runs the model with other environment variables (a torchrun worker)
computes its own and hands it back.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from harness.golden.errors import GoldenFormatError

__all__ = ["PIN_VARIABLES", "NumericsFingerprint", "current_fingerprint", "fingerprint_from_json"]

PIN_VARIABLES: tuple[str, ...] = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "MHC_BACKEND",
    "MHC_NATIVE",
)
"""Environment variables recorded in `pins` when set: each selects a code path or a summation order.
Thread variables are not among them: `threads` records the count torch runs with, whatever set it."""

_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
)
"""CPU flags (`/proc/cpuinfo`) kept in `cpu_isa`: the vector extensions a library may dispatch to."""

_KERNEL_LIBS = ("cuda-tile", "transformer-engine", "triton", "tile-kernels")

_ID_LEN = 12


@dataclass(frozen=True, kw_only=True)
class NumericsFingerprint:
    """What decides bitwise results of a run (see the module docstring); `id` digests all of it."""

    device: str
    """`cpu` or `cuda`: where the model ran."""
    cpu_vendor: str
    cpu_model: str
    """Model name, then `family/model/stepping` where the OS reports them."""
    cpu_isa: tuple[str, ...] = ()
    cpu_capability: str | None = None
    blas: str | None = None
    onednn: str | None = None
    pins: Mapping[str, str] = field(default_factory=dict)
    threads: int | None = None
    torch: str | None = None
    megatron_core: str | None = None
    gpu: str | None = None
    """`<name> x<count>` on a GPU run."""
    driver: str | None = None
    cuda: str | None = None
    cudnn: str | None = None
    kernel_libs: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"NumericsFingerprint.device={self.device!r} must be 'cpu' or 'cuda'")
        for name in ("cpu_vendor", "cpu_model"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"NumericsFingerprint.{name}={getattr(self, name)!r} must be a string")
        object.__setattr__(self, "cpu_isa", tuple(sorted(self.cpu_isa)))
        object.__setattr__(self, "pins", dict(sorted(self.pins.items())))
        object.__setattr__(self, "kernel_libs", dict(sorted(self.kernel_libs.items())))

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object (`cpu_isa` a list)."""
        d = asdict(self)
        d["cpu_isa"] = list(self.cpu_isa)
        return d

    @property
    def id(self) -> str:
        """12 hex digits of the sha256 of the canonical JSON of every field."""
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:_ID_LEN]

    @property
    def label(self) -> str:
        """One line for reports: `<id> (<cpu>, <isa path>, <libraries>, <threads>, <versions>)`."""
        parts = [f"{self.cpu_vendor} {self.cpu_model}".strip()]
        if self.device == "cuda":
            parts = [
                self.gpu or "GPU",
                f"driver {self.driver}",
                f"CUDA {self.cuda}",
                f"cuDNN {self.cudnn}",
                *(f"{k} {v}" for k, v in self.kernel_libs.items()),
                f"host {parts[0]}",
            ]
        else:
            parts.append(f"ATen {self.cpu_capability or '?'}")
            if self.blas:
                parts.append(
                    self.blas + (f" CBWR={self.pins['MKL_CBWR']}" if "MKL_CBWR" in self.pins else "")
                )
            if self.onednn:
                cap = self.pins.get("ONEDNN_MAX_CPU_ISA") or self.pins.get("DNNL_MAX_CPU_ISA")
                parts.append(f"oneDNN {self.onednn}" + (f" max {cap}" if cap else ""))
        if self.threads is not None:
            parts.append(f"{self.threads} thread{'s' if self.threads != 1 else ''}")
        parts.append(f"torch {self.torch}")
        if self.megatron_core:
            parts.append(f"megatron-core {self.megatron_core}")
        return f"{self.id} ({', '.join(parts)})"

    def differences(self, other: NumericsFingerprint) -> list[str]:
        """`field: this -> other` for every field that differs (what makes two runs' bits differ)."""
        a, b = self.to_json(), other.to_json()
        return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]


def fingerprint_from_json(doc: Any, *, source: str) -> NumericsFingerprint:
    """Parse `NumericsFingerprint.to_json`'s object; `GoldenFormatError` naming `source`."""
    names = {f.name for f in fields(NumericsFingerprint)}
    if not isinstance(doc, Mapping):
        raise GoldenFormatError(
            f"{source}: a numerics fingerprint is a JSON object, got {type(doc).__name__}"
        )
    extra = sorted(set(doc) - names)
    if extra:
        raise GoldenFormatError(
            f"{source}: unknown numerics fingerprint key(s) {extra}; known: {sorted(names)}"
        )
    try:
        return NumericsFingerprint(
            **{k: (tuple(v) if k == "cpu_isa" and isinstance(v, list) else v) for k, v in doc.items()}
        )
    except (TypeError, ValueError) as exc:
        raise GoldenFormatError(f"{source}: not a numerics fingerprint ({exc})") from None


def _cpuinfo() -> dict[str, str]:
    """The first processor's entries of `/proc/cpuinfo` (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def _cpu(info: Mapping[str, str]) -> tuple[str, str, tuple[str, ...]]:
    vendor = (
        info.get("vendor_id") or info.get("CPU implementer") or platform.processor() or platform.machine()
    )
    name = info.get("model name") or info.get("Processor") or platform.processor() or platform.machine()
    ids = [info.get(k) for k in ("cpu family", "model", "stepping")]
    if all(ids):
        name = f"{name} {'/'.join(ids)}"
    elif info.get("CPU part"):
        name = f"{name} part {info['CPU part']}"
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return vendor, name, tuple(f for f in _ISA_FLAGS if f in flags)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _torch_libraries(torch: Any) -> tuple[str | None, str | None]:
    """`("MKL 2024.2", "3.12.0")` from `torch.__config__.show()`; None where absent."""
    try:
        text = torch.__config__.show()
    except Exception:  # noqa: BLE001 - a build without the config string
        return None, None
    blas = None
    if m := re.search(r"Math Kernel Library Version ([\d.]+)", text):
        blas = f"MKL {m.group(1)}"
    elif m := re.search(r"BLAS_INFO=(\w+)", text):
        blas = m.group(1)
    onednn = m.group(1) if (m := re.search(r"(?:MKL-DNN|oneDNN) v([\d.]+)", text)) else None
    return blas, onednn


def _driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def current_fingerprint(*, env: Mapping[str, str] | None = None) -> NumericsFingerprint:
    """This process's fingerprint. Imports torch where it is installed (a process without torch gets
    one without the torch fields); `env` replaces `os.environ` for `pins` (tests)."""
    env = os.environ if env is None else env
    vendor, model, isa = _cpu(_cpuinfo())
    kw: dict[str, Any] = dict(
        device="cpu",
        cpu_vendor=vendor,
        cpu_model=model,
        cpu_isa=isa,
        pins={k: env[k] for k in PIN_VARIABLES if env.get(k)},
        torch=_version("torch"),
        megatron_core=_version("megatron-core"),
    )
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        import torch

        kw["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        kw["blas"], kw["onednn"] = _torch_libraries(torch)
        kw["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            kw.update(
                device="cuda",
                gpu=f"{torch.cuda.get_device_name(0)} x{n}",
                driver=_driver(),
                cuda=torch.version.cuda,
                cudnn=str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
                kernel_libs={k: v for k in _KERNEL_LIBS if (v := _version(k))},
            )
    return NumericsFingerprint(**kw)
