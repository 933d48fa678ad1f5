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

# What ``enabled`` returns, and so the ``PDL`` constexpr a kernel gets: off, or on with the kernel letting its
# successor launch after its own wait or before it. Both orders are correct, since the successor's wait still
# waits for this kernel to finish; they differ in how early the successor's programs start on what they may do
# before their wait (a GEMV's weight prefetch, the decode attention's first key tile). On an H100, at batch 1
# the early trigger made LLaMA-1.1B's step faster (behind a short kernel such as the split-KV merge, the next
# GEMV otherwise launches too late for its 8 MB prefetch to hide), but at batch 16 it made LLaMA's and GPT-2's
# steps slower. So it is the caller's choice (``early_trigger``): the decode step takes it at batch 1.
OFF, TRIGGER_AFTER_WAIT, TRIGGER_BEFORE_WAIT = 0, 1, 2

_MODE = contextvars.ContextVar("flash_kernels_programmatic_launch", default=OFF)


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True, *, early_trigger: bool = False):
    """Within this block our decode-path kernels launch with programmatic dependent launch where the GPU
    supports it (compute capability 9.0+); elsewhere, or with ``enabled=False``, they launch as usual.
    ``early_trigger``: each kernel lets the next one launch before waiting for the one before it, and the
    decode attention reads its first key tile before that wait: faster for a latency-bound chain (batch 1),
    slower for a wider one (see ``TRIGGER_BEFORE_WAIT``)."""
    token = _MODE.set(OFF if not enabled else TRIGGER_BEFORE_WAIT if early_trigger else TRIGGER_AFTER_WAIT)
    try:
        yield
    finally:
        _MODE.reset(token)


def enabled(device: torch.device) -> int:
    """Whether a kernel launched now on ``device`` should use PDL, as the ``PDL`` constexpr the kernel takes:
    ``OFF`` (0, falsy), ``TRIGGER_AFTER_WAIT`` or ``TRIGGER_BEFORE_WAIT``. Never in code torch.compile traces: its
    own kernels take no part in the chain, and Dynamo (torch 2.11) cannot trace ``ContextVar.get``."""
    if torch.compiler.is_compiling():
        return OFF
    mode = _MODE.get()
    return mode if mode != OFF and pdl_supported(device) else OFF


def launch_options(pdl: int) -> dict:
    """The launch keyword that marks a PDL launch (none otherwise, so ordinary launches keep their key)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """With PDL, before the kernel touches memory: wait until the kernel before it has finished (its writes
    visible), and let the kernel after it launch (before or after that wait, as ``PDL`` says). Without PDL,
    nothing (the stream already orders them)."""
    if PDL == 2:  # TRIGGER_BEFORE_WAIT
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:  # TRIGGER_AFTER_WAIT
        tl.extra.cuda.gdc_launch_dependents()
