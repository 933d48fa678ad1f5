"""Packaging hook for the optional ahead-of-time build of the fused_dense CUDA extension.

Metadata lives in pyproject.toml. A default ``pip install .`` compiles nothing (the extension is then built
on first use, JIT). ``FLASH_KERNELS_BUILD_EXT=1 pip install --no-build-isolation .`` builds it now, which
needs torch importable at build time and nvcc with the cuBLAS headers.
"""

import os

from setuptools import setup


def _extension_kwargs() -> dict:
    if os.environ.get("FLASH_KERNELS_BUILD_EXT", "0") in ("", "0"):
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    csrc = "kernels/flash_kernels/csrc"
    ext = CUDAExtension(
        "flash_kernels._fused_dense_C",
        [f"{csrc}/fused_dense.cpp", f"{csrc}/fused_dense_cuda.cu"],
        libraries=["cublasLt"],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extension_kwargs())
