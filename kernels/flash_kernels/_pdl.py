"""Programmatic dependent launch (PDL): let a chain of our kernels overlap their launches.

A decode step at batch 1 is a few hundred short kernels, each taking a few microseconds; between two of them
the GPU drains one grid, then launches and schedules the next. On Hopper a kernel launched with the PDL
attribute may start while the kernel before it still runs: its programs wait in-kernel (``gdc_wait``) until
that kernel has finished and its writes are visible, so the result is the same, but the launch and the block
scheduling are off the critical path. A kernel in turn lets its successor launch early by calling
``gdc_launch_dependents`` (the successor launches once every program of this kernel has called it).

``programmatic_launch()`` turns this on for the kernels launched inside it (a decode step being captured into
a CUDA graph, say). Every PDL-aware kernel calls ``wait_for_predecessor`` before it loads or stores anything a
kernel may write (only what none writes, a model's weights, may be read before: ``gemv(static_weight=True)``)
and asks ``enabled(device)`` at launch, which gives its ``PDL`` constexpr and the ``launch_pdl`` option.
Kernels that are not PDL-aware (cuBLAS, torch's own) keep their ordinary stream order, and so does everything
outside the context: there is nothing to get wrong for a caller who never enters it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ._triton_compat import tl, triton
from ._triton_utils import pdl_supported

_ENABLED = contextvars.ContextVar("flash_kernels_programmatic_launch", default=False)


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True):
    """Within this block our decode-path kernels launch with programmatic dependent launch where the GPU
    supports it (compute capability 9.0+); elsewhere, or with ``enabled=False``, they launch as usual."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` should use PDL. Never in code torch.compile traces: its own
    kernels take no part in the chain, and Dynamo (torch 2.11) cannot trace ``ContextVar.get``."""
    if torch.compiler.is_compiling():
        return False
    return _ENABLED.get() and pdl_supported(device)


def launch_options(pdl: bool) -> dict:
    """The launch keyword that marks a PDL launch (none otherwise, so ordinary launches keep their key)."""
    return {"launch_pdl": True} if pdl else {}


# Where a kernel lets its successor launch: before its own wait (True) or after it. Either is correct, since
# the successor's wait still waits for this kernel to finish; what differs is how early the successor's programs
# get going on what they may do before their wait (a GEMV's weight prefetch). Triggering after the wait meant
# that behind a short kernel (the split-KV merge) the next GEMV launched only once that kernel had started its
# real work, so its 8 MB weight prefetch had nothing left to hide behind. A grid larger than one wave triggers
# only when its last programs start, either way.
EARLY_TRIGGER = tl.constexpr(True)


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """With PDL, before the kernel touches memory: let the kernel after it launch, and wait until the kernel
    before it has finished (its writes visible). Without PDL, nothing (the stream already orders them)."""
    if PDL:
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
