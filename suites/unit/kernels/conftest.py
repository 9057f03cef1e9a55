"""Kernel parity suite: keep torch.compile's cost bounded on small CI machines.

Inductor compiles each graph's C++ in a pool of worker processes by default; with 2 cores and
2 xdist workers the pool costs more than it saves (measured: 120 s -> 70 s for this directory,
cold cache). Unless TORCHINDUCTOR_COMPILE_THREADS is set, compile in-process.
"""

from __future__ import annotations

import os


def pytest_configure(config):
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
