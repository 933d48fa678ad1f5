"""Triton where it is installed, else a stand-in with which every op module still imports.

Triton ships for Linux only, so on macOS or Windows (or any machine without it) ``import triton`` fails. The
op modules define their kernels at import time with ``@triton.jit`` / ``@triton.autotune``; here those
decorators then return kernels that cannot launch, and ``_backend.use_triton`` never picks them: backend
"auto" runs the PyTorch references, and backend="triton" raises a ValueError that says Triton is missing.
The few plain helpers used outside kernels (``cdiv``, ``next_power_of_2``, ``Config``) work either way.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False

    class _UnlaunchableKernel:
        """What ``@triton.jit`` / ``@triton.autotune`` make without Triton: a kernel that refuses to launch."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.__name__}: Triton is not installed, so its kernels cannot launch")

    class _MissingTriton:
        __version__ = "not installed"

        class Config:
            def __init__(self, kwargs, num_warps=4, num_stages=2, **extra):
                self.kwargs, self.num_warps, self.num_stages = dict(kwargs), num_warps, num_stages

        @staticmethod
        def jit(fn=None, **options):
            return _UnlaunchableKernel(fn) if fn is not None else _UnlaunchableKernel

        @staticmethod
        def autotune(configs, key, **options):
            return lambda kernel: kernel

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << (int(n) - 1).bit_length() if n > 1 else 1

    class _MissingLanguage:
        @staticmethod
        def constexpr(value):
            return value

    triton = _MissingTriton()
    tl = _MissingLanguage()

__all__ = ["TRITON_AVAILABLE", "tl", "triton"]
