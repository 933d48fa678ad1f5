"""Which implementation of an op runs: the plain PyTorch reference or our Triton kernels.

Every public op takes ``backend=`` in {"reference", "triton", "auto"} (``None`` is "auto"); a model takes the
same vocabulary as ``kernel_backend=`` and passes its choice to every op it calls. Nothing here reads the
environment: a backend is what the caller passed.

- "reference": the PyTorch reference, on any device. It is the CPU path and the test oracle.
- "triton": our kernels: Triton's, and for ``fused_dense`` our CUDA C++ extension. Triton's run on CUDA, or on
  the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported), which is how CI
  tests them. If they cannot run here, a ValueError says why.
- "auto": our kernels on CUDA when the op supports the input, else the reference. Never the interpreter: it
  is a test tool, thousands of times slower than the reference.

The decision is an explicit check of device, dtype and shape, never a try/except around a launch.
"""

from __future__ import annotations

import os
import warnings
from typing import Literal

import torch

from ._triton_compat import NOT_LOADED_REASON, TRITON_AVAILABLE

KernelBackend = Literal["reference", "triton", "auto"]
BACKENDS: tuple[str, ...] = ("reference", "triton", "auto")
# A retired setting: the backend is an argument, never the environment, so that every kernel a model launches
# follows the model's own choice. Whoever still sets it gets one warning that says what to pass instead.
RETIRED_ENV_VAR = "FLASH_KERNELS_BACKEND"
if os.environ.get(RETIRED_ENV_VAR):
    warnings.warn(
        f"{RETIRED_ENV_VAR} is no longer read; pass kernel_backend= to fm.from_pretrained / fm.create_model (or "
        "backend= to a flash_kernels op) instead", FutureWarning, stacklevel=2,
    )


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend_name(backend: str | None) -> str:
    """``backend`` checked against the vocabulary; None is "auto"."""
    if backend is None:
        return "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a kernel backend; use one of {BACKENDS}")
    return backend


def use_triton(backend: str | None, x: torch.Tensor, *, op: str, unsupported: str | None = None) -> bool:
    """True when ``op`` should run our Triton kernel on ``x``.

    ``unsupported`` is the op's own reason it cannot take this input (a dtype, a head dim, a shape), or None.
    An empty ``x`` takes the reference on every backend (once the device is one the kernels run on): there is
    nothing to launch, and the reference's empty result (and gradients) are what the kernel's would be.
    """
    backend = check_backend_name(backend)
    if backend == "reference":
        return False
    if not TRITON_AVAILABLE:
        if backend == "auto":
            return False
        raise ValueError(f"{op}: backend='triton' needs Triton: {NOT_LOADED_REASON}. Use backend='reference' or 'auto'.")
    on_device = x.device.type == "cuda" or (x.device.type == "cpu" and triton_interpreter_enabled())
    if backend == "auto":
        return x.device.type == "cuda" and x.numel() > 0 and unsupported is None
    if not on_device:
        raise ValueError(
            f"{op}: backend='triton' cannot run on device {x.device.type!r}: the Triton kernels need a CUDA "
            "tensor (or TRITON_INTERPRET=1 set before importing triton, for tests). Use backend='reference' "
            "or 'auto'."
        )
    if x.numel() == 0:
        return False
    if unsupported is not None:
        raise ValueError(f"{op}: backend='triton' cannot run this input: {unsupported}. Use backend='auto'.")
    return True


def records_grad(*args) -> bool:
    """Whether autograd would record a call taking ``args``: grad mode is on and a tensor among them needs a
    gradient (non-tensor arguments and None are ignored)."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def needs_grad_reason(*tensors: torch.Tensor | None) -> str | None:
    """The ``unsupported`` reason of an inference-only kernel (no backward) when autograd would record it."""
    if records_grad(*tensors):
        return "an input that needs gradients (the kernel has no backward; run it under torch.no_grad)"
    return None


def capturing_cuda_graph() -> bool:
    """True while the current CUDA stream is being captured into a graph (host syncs are illegal then).
    Never initializes CUDA: without it initialized, nothing can be capturing."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference computes in: float32 for every float type, float64 for float64 (whose users, such
    as torch.autograd.gradcheck, ask for its precision and would silently get float32's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def holds_integers(t: torch.Tensor) -> bool:
    """Whether t's dtype can hold ids (token ids, labels, positions): an integer one, bool excluded."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def check_ids_in_range(ids: torch.Tensor, high: int, *, message: str, ignore: int | None = None,
                       static_input: bool = False) -> None:
    """Every id in [0, high) (or equal to ``ignore``); ``message`` names the problem and the fix. Ids of a
    floating, complex or bool dtype are refused with that message, on every device.

    On the CPU a ValueError says so, naming the first bad id. On CUDA the check is an asynchronous device
    assert: reading the answer on the host would stall the launch queue once per forward, and an
    out-of-range id must still never index silently out of bounds. While a CUDA graph is captured nothing is
    checked (or launched): a replay would test the capture's ids, not its own; the capturer checks the ids
    it copies in, or passes ``static_input=True`` for ids that are the graph's static input buffer, whose
    captured check then tests each replay's own ids.
    """
    if not holds_integers(ids):
        # Else torch's own error (an embedding's or a gather's) would name none of the caller's inputs.
        raise ValueError(f"{message}; got a tensor of {ids.dtype}: pass integer ids (torch.long)")
    compiling = torch.compiler.is_compiling()  # traced into the graph: no host read, no capture query
    if ids.is_cuda and not compiling and not static_input and capturing_cuda_graph():
        return
    valid = (ids >= 0) & (ids < high)
    if ignore is not None:
        valid |= ids == ignore
    if compiling or ids.is_cuda:
        torch._assert_async(valid.all(), message)
        return
    if not bool(valid.all()):
        raise ValueError(f"{message} (first bad value: {int(ids[~valid][0])})")
