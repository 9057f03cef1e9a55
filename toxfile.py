"""tox inline plugin: the CPU suite envs (unit, pp, functional, perf, lint, harness) share ONE
virtualenv, so torch and megatron-core are installed once.

tox 4 keys an environment directory by the env's name and recreates it when another env uses it.
The `shared-virtualenv` runner records one fixed name instead; everything else (the interpreter,
deps, extras and package checks) is tox's own, so a changed dependency still recreates the env.
"""

from __future__ import annotations

from contextlib import contextmanager

from tox.plugin import impl
from tox.tox_env.info import Info
from tox.tox_env.python.virtual_env.runner import VirtualEnvRunner

SHARED_NAME = "cpu-shared"


class _SharedInfo(Info):
    @contextmanager
    def compare(self, value, section, sub_section=None):
        if section == "ToxEnv" and isinstance(value, dict) and "name" in value:
            value = {**value, "name": SHARED_NAME}
        with super().compare(value, section, sub_section) as result:
            yield result


class SharedVirtualEnvRunner(VirtualEnvRunner):
    """A virtualenv runner whose environment directory may be shared by several env names."""

    @staticmethod
    def id() -> str:
        return "shared-virtualenv"

    @property
    def cache(self) -> Info:
        return _SharedInfo(self.env_dir)


@impl
def tox_register_tox_env(register) -> None:
    register.add_run_env(SharedVirtualEnvRunner)
