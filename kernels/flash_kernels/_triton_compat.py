"""Triton where it is installed, else a stand-in with which every op module still imports.

Triton ships for Linux only, so on macOS or Windows (or any machine without it) ``import triton`` fails. The
op modules define their kernels at import time with ``@triton.jit`` / ``@triton.autotune``; here those
decorators then return kernels that cannot launch, and ``_backend.use_triton`` never picks them: backend
"auto" runs the PyTorch references, and backend="triton" raises a ValueError that says Triton is missing.
The few plain helpers used outside kernels (``cdiv``, ``next_power_of_2``, ``Config``) work either way.

The stand-in also serves where Triton is installed but nothing here can run its kernels: no CUDA GPU, no
interpreter (``TRITON_INTERPRET=1``, which must be set before the first op module is imported, as before
Triton's own import), and no Triton imported by the program itself. Importing Triton costs about a second and pulls in most of its compiler; a CPU machine
runs the references only, so it is never imported there (``TRITON_INSTALLED`` then tells the two cases apart
for the error messages).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

import torch


def _installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules (tests that hide Triton), a broken install
        return False


def _worth_loading() -> bool:
    """A CUDA GPU or Triton's interpreter asked for (the only places a Triton kernel runs), or a program that
    imported Triton itself (one compiling kernels ahead of time for a GPU it does not have): loading costs
    nothing more there."""
    return ("triton" in sys.modules or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            or torch.cuda.is_available())


TRITON_INSTALLED = _installed()
TRITON_AVAILABLE = False  # whether ``triton`` below is Triton itself
if TRITON_INSTALLED and _worth_loading():
    try:
        import triton
        import triton.language as tl

        TRITON_AVAILABLE = True
    except ImportError:
        TRITON_INSTALLED = False

# Why the stand-in is here, for the errors that name it.
NOT_LOADED_REASON = ("Triton is installed but was not loaded: there is no CUDA GPU here and TRITON_INTERPRET=1 was "
                     "not set before flash_kernels' first op was imported" if TRITON_INSTALLED
                     else "Triton is not installed here (it ships for Linux only)")

if not TRITON_AVAILABLE:

    class _UnlaunchableKernel:
        """What ``@triton.jit`` / ``@triton.autotune`` make without Triton: a kernel that refuses to launch."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.__name__}: {NOT_LOADED_REASON}, so its kernels cannot launch")

    class _MissingTriton:
        __version__ = f"{importlib.metadata.version('triton')} (not loaded)" if TRITON_INSTALLED else "not installed"

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

__all__ = ["NOT_LOADED_REASON", "TRITON_AVAILABLE", "TRITON_INSTALLED", "tl", "triton"]
