"""The C extension of mhc-core (everything else is in pyproject.toml): the native CPU forward of the fused
pre-op, `mhc_core/kernels/native/pre.c` (with its SIMD template `pre_simd.h`). Optional: where it cannot be compiled the package installs
without it and the compiled backend keeps its torch.compile forward (`mhc_core.kernels.native`)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mhc_core.kernels.native._pre", sources=["mhc_core/kernels/native/pre.c"],
                             depends=["mhc_core/kernels/native/pre_simd.h"], extra_compile_args=["-O3"],
                             optional=True)])
