"""CPU numerics profiles: which vector code paths a CPU run (gloo) of a functional case takes.

A profile is a set of environment variables that cap the ISA of torch's own kernels (ATen), MKL's
BLAS (its conditional numerical reproducibility mode, CBWR) and oneDNN. The default, `avx2`,
runs the same code paths on every x86-64 CI machine; the others exist to measure how far results
move when the code paths change (`docs/functional.md`, "Numerics profiles"), and to stand in
for "another machine" in one box (`test_other_machine.py`). Each profile's pins are recorded in
the run's numerics fingerprint (`harness.golden.fingerprint`), so an exact golden recorded under one
profile is never enforced under another.

`MHC_CPU_NUMERICS` chooses the profile for a session; a recipe's `ENV_VARS` still override
single variables.
"""

from __future__ import annotations

import enum
import os
import platform
from collections.abc import Mapping

__all__ = ["CPU_NUMERICS_ENV_VAR", "CpuNumerics", "cpu_isa_pins", "cpu_numerics"]

CPU_NUMERICS_ENV_VAR = "MHC_CPU_NUMERICS"


class CpuNumerics(enum.StrEnum):
    """The named CPU numerics profiles."""

    AVX2 = "avx2"
    """ATen, MKL and oneDNN capped at AVX2 (the default: every x86-64 CI machine has it)."""
    BASELINE = "baseline"
    """ATen's unvectorised kernels, MKL's COMPATIBLE path, oneDNN capped at SSE4.1."""
    NATIVE = "native"
    """Nothing pinned: each library dispatches to the best ISA of the machine (AVX-512, AMX)."""


_PINS: dict[CpuNumerics, dict[str, str]] = {
    CpuNumerics.AVX2: {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "DNNL_MAX_CPU_ISA": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    CpuNumerics.BASELINE: {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_CBWR": "COMPATIBLE",
        "DNNL_MAX_CPU_ISA": "SSE41",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
    CpuNumerics.NATIVE: {},
}


def cpu_numerics(env: Mapping[str, str] | None = None) -> CpuNumerics:
    """The profile `$MHC_CPU_NUMERICS` names (default `avx2`); `ValueError` naming it otherwise."""
    raw = (os.environ if env is None else env).get(CPU_NUMERICS_ENV_VAR, "") or CpuNumerics.AVX2.value
    try:
        return CpuNumerics(raw)
    except ValueError:
        raise ValueError(
            f"{CPU_NUMERICS_ENV_VAR}={raw!r} is not a CPU numerics profile; "
            f"valid: {', '.join(p.value for p in CpuNumerics)}"
        ) from None


def cpu_isa_pins(
    backend: str, machine: str | None = None, profile: CpuNumerics | None = None
) -> dict[str, str]:
    """The pins of `profile` (default: `cpu_numerics`) for a CPU run (gloo) on x86-64, else none
    (GPU runs, other architectures)."""
    machine = platform.machine() if machine is None else machine
    if backend != "gloo" or machine.lower() not in ("x86_64", "amd64"):
        return {}
    return dict(_PINS[profile or cpu_numerics()])
