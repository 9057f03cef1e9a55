"""The C extension of mhc-core (everything else is in pyproject.toml): the native CPU forward of the fused
pre-op, `mhc_core/kernels/native/pre.c` (with its SIMD template `pre_simd.h`). Optional: where it cannot be
compiled the package installs without it and the compiled backend keeps its torch.compile forward
(`mhc_core.kernels.native`). Built with OpenMP where the compiler has it (its threads are torch's own pool, see
pre.c), else without (one thread)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = ["-fopenmp"]


class BuildExt(build_ext):
    """The extension with OpenMP, and again without it where the compiler refuses the flag."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception:  # noqa: BLE001 - any compiler failure: retry without OpenMP, then let `optional` decide
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
            ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
            super().build_extension(ext)


setup(ext_modules=[Extension("mhc_core.kernels.native._pre", sources=["mhc_core/kernels/native/pre.c"],
                             depends=["mhc_core/kernels/native/pre_simd.h"], extra_compile_args=["-O3", *OPENMP],
                             extra_link_args=OPENMP, optional=True)],
      cmdclass={"build_ext": BuildExt})
