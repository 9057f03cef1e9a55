"""Hardware keys: which golden directory (`golden/<hw>/...`) a machine reads and writes.

A key names a kind of machine, never a host. The order of precedence is: an explicit option
(`--hw`), then the environment variable `MHC_HW`, then detection. Detection asks
`nvidia-smi` for the GPU names (falling back to `torch.cuda` when `nvidia-smi` is
absent and torch is installed) and maps them with `key_for_gpus`:

| GPU name contains | count | key |
|---|---|---|
| `GB200` | any | `dgx_gb200` |
| `H200` (not `GH200`) | any | `h200` |
| `H100` | 8 | `dgx_h100` |
| `H100` | other | `h100` |
| `A100` | 8 | `dgx_a100` |
| `A100` | other | `a100` |
| anything else | n | `gpu_<name>_x<n>` |
| no GPU | - | `cpu_<arch>` |

The `dgx_*` names are Megatron-LM's platform names, so its `golden_values_*_dgx_h100.json`
files map one to one. Keys outside `KNOWN_HW_KEYS` work for reading and comparing but
recalibration refuses them unless explicitly allowed (`require_known`).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from harness.golden.errors import UnknownHardwareError

__all__ = [
    "HW_ENV_VAR",
    "KNOWN_HW_KEYS",
    "HardwareKey",
    "detect_hardware",
    "key_for_cpu",
    "key_for_gpus",
    "probe_gpus",
    "require_known",
    "validate_hw_key",
]

HW_ENV_VAR = "MHC_HW"
"""Environment variable that overrides detection (the `--hw` option overrides it in turn)."""

KNOWN_HW_KEYS: tuple[str, ...] = (
    "dgx_h100",
    "dgx_a100",
    "dgx_gb200",
    "h200",
    "h100",
    "a100",
    "cpu_x86_64",
    "cpu_aarch64",
    "cpu_arm64",
)
"""Keys recalibration accepts without `--allow-unknown-hw`."""

_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")

# (pattern, required count or None for any, key); first match wins.
_GPU_RULES: tuple[tuple[str, int | None, str], ...] = (
    (r"\bGB200\b", None, "dgx_gb200"),
    (r"\bH200\b", None, "h200"),
    (r"\bH100\b", 8, "dgx_h100"),
    (r"\bH100\b", None, "h100"),
    (r"\bA100\b", 8, "dgx_a100"),
    (r"\bA100\b", None, "a100"),
)


@dataclass(frozen=True, kw_only=True)
class HardwareKey:
    """A resolved hardware key and the rule that produced it."""

    key: str
    """The directory name under `golden/`, e.g. `dgx_h100` or `cpu_x86_64`."""
    rule: str
    """Human-readable reason: which rule matched, on which input."""
    source: Literal["option", "env", "gpu", "cpu"]
    """Where the key came from."""

    @property
    def known(self) -> bool:
        """Whether the key is in `KNOWN_HW_KEYS`."""
        return self.key in KNOWN_HW_KEYS


def _sanitize(text: str) -> str:
    out = re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
    return out or "unknown"


def validate_hw_key(key: str, *, field: str = "hw") -> str:
    """Return `key` if it is a valid directory-safe key, else raise `ValueError` naming `field`."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(
            f"{field}={key!r} is not a valid hardware key: use lowercase letters, digits, '_', '.', '-' "
            f"(at most 64 characters, no '/'), e.g. one of {', '.join(KNOWN_HW_KEYS)}"
        )
    return key


def key_for_gpus(name: str, count: int) -> tuple[str, str]:
    """Map one GPU model name and the number of such GPUs to `(key, rule)`.

    Pure function: `key_for_gpus("NVIDIA H100 80GB HBM3", 8) == ("dgx_h100", ...)`.
    """
    if count < 1:
        raise ValueError(f"count={count!r} must be >= 1")
    for pattern, need, key in _GPU_RULES:
        if re.search(pattern, name, flags=re.IGNORECASE) and (need is None or need == count):
            how = "any count" if need is None else f"exactly {need}"
            return key, f"GPU name {name!r} x{count} matches /{pattern}/ with {how} -> {key}"
    stem = _sanitize(re.sub(r"^\s*nvidia\s+", "", name, flags=re.IGNORECASE))
    key = f"gpu_{stem}_x{count}"[:64]
    return key, f"GPU name {name!r} x{count} matches no known platform -> sanitized {key} (unknown key)"


def key_for_cpu(machine: str) -> tuple[str, str]:
    """Map `platform.machine()` (e.g. `x86_64`) to `(cpu_<arch>, rule)`."""
    key = f"cpu_{_sanitize(machine)}"
    return key, f"no GPU found -> cpu_<arch> with arch={machine!r} from platform.machine()"


def probe_gpus(timeout_s: float = 10.0) -> tuple[list[str], str]:
    """Return the GPU names of this machine and how they were found.

    Tries `nvidia-smi --query-gpu=name` first (no CUDA context, lists every GPU of the node),
    then, when an NVIDIA driver is present, `torch.cuda` if torch is installed (so a CPU machine
    never pays for importing torch). Returns `([], reason)` when there is no GPU.
    """
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            smi = f"nvidia-smi failed ({exc.__class__.__name__})"
        else:
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            if out.returncode == 0 and names:
                return names, "nvidia-smi"
            smi = f"nvidia-smi returned {out.returncode} with no GPU"
    else:
        smi = "nvidia-smi not found"
    if not (os.path.exists("/proc/driver/nvidia/version") or glob.glob("/dev/nvidia[0-9]*")):
        return [], f"{smi}; no NVIDIA driver (/proc/driver/nvidia absent)"
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return [torch.cuda.get_device_name(i) for i in range(n)], "torch.cuda"
        return [], f"{smi}; torch.cuda unavailable"
    return [], f"{smi}; torch not installed"


def detect_hardware(
    *,
    override: str | None = None,
    env: Mapping[str, str] | None = None,
    probe: Callable[[], tuple[Sequence[str], str]] | None = None,
    machine: str | None = None,
) -> HardwareKey:
    """Resolve the hardware key: `override` (`--hw`), then `$MHC_HW`, then detection.

    `probe` and `machine` replace `probe_gpus` and `platform.machine()` (tests).
    """
    if override is not None:  # an empty --hw is an error, not "detect"
        return HardwareKey(
            key=validate_hw_key(override, field="--hw"), rule="given by option --hw", source="option"
        )
    env = os.environ if env is None else env
    if env.get(HW_ENV_VAR):
        key = validate_hw_key(env[HW_ENV_VAR], field=HW_ENV_VAR)
        return HardwareKey(key=key, rule=f"given by environment variable {HW_ENV_VAR}", source="env")
    names, how = (probe or probe_gpus)()
    if names:
        (name, count), *others = Counter(names).most_common()
        key, rule = key_for_gpus(name, count)
        rule = f"{rule} (GPUs listed by {how})"
        if others:
            rule += f"; mixed GPUs, ignored: {', '.join(f'{n!r} x{c}' for n, c in others)}"
        return HardwareKey(key=key, rule=rule, source="gpu")
    key, rule = key_for_cpu(machine if machine is not None else platform.machine())
    return HardwareKey(key=key, rule=f"{rule} ({how})", source="cpu")


def require_known(key: str, *, allow_unknown: bool = False) -> str:
    """Raise `UnknownHardwareError` unless `key` is known or `allow_unknown` is set."""
    if key not in KNOWN_HW_KEYS and not allow_unknown:
        raise UnknownHardwareError(
            f"hardware key {key!r} is not a known key ({', '.join(KNOWN_HW_KEYS)}); "
            "pass --hw with a known key, or --allow-unknown-hw to create golden values for it"
        )
    return key
