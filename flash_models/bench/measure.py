"""User-facing benchmark helpers in the spirit of the original flash-attention ``benchmark_forward`` /
``benchmark_backward`` / ``benchmark_memory``: time or measure the memory of any module or function.

    from flash_models.bench.measure import benchmark_forward, benchmark_fwd_bwd, benchmark_memory
    t = benchmark_forward(model, input_ids, desc="gpt2")          # Timing (median_ms, min_ms, repeats)
    t = benchmark_backward(lambda x: model(x).logits, input_ids)   # backward only, on a fixed forward
    mem = benchmark_memory(model, input_ids)                       # peak bytes above the starting point

On CUDA the timings come from CUDA events (``harness.time_cuda``); on the CPU from ``time.perf_counter``, so the
same calls run (slowly, and as a smoke test) in CI. ``amp_dtype`` wraps the calls in autocast. Backward passes
run on the calling thread (``flash_models.backward_on_this_thread``), as the Trainer runs them.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import statistics
import time
from typing import Callable

import torch

from ..backward import backward_on_this_thread
from .harness import Timing, time_cuda

log = logging.getLogger(__name__)


def _autocast(device_type: str, amp_dtype: torch.dtype | None):
    return torch.autocast(device_type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()


def _device_of(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def time_fn(fn: Callable[[], object], *, device: torch.device, warmup: int = 3, repeats: int = 10) -> Timing:
    """Median time of ``fn``: CUDA events on a GPU, wall clock elsewhere."""
    if device.type == "cuda":
        return time_cuda(fn, warmup=warmup, repeats=repeats)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(median_ms=statistics.median(times), min_ms=min(times), repeats=repeats)


def _outputs(out) -> list[torch.Tensor]:
    """The differentiable tensors of a module's output: a tensor, a tuple, or an object with .loss/.logits."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
    for name in ("loss", "logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return [value]
    raise TypeError(f"cannot find a differentiable output in {type(out).__name__}")


def benchmark_forward(fn: Callable, *args, repeats: int = 10, warmup: int = 3, desc: str = "", amp_dtype=None,
                      verbose: bool = False, **kwargs) -> Timing:
    """Forward time of ``fn(*args, **kwargs)`` (a module or any function), without autograd."""
    device = _device_of(args)

    def run():
        with torch.no_grad(), _autocast(device.type, amp_dtype):
            fn(*args, **kwargs)

    timing = time_fn(run, device=device, warmup=warmup, repeats=repeats)
    if verbose:
        log.info("%s forward: %.3f ms", desc, timing.median_ms)
    return timing


def backward_and_drop_grads(loss: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The backward of one benchmarked training step, run as the Trainer runs it (on the calling thread), then
    every gradient dropped so that the next step starts alike. Returns ``loss``."""
    with backward_on_this_thread():
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss


def benchmark_backward(fn: Callable, *args, repeats: int = 10, warmup: int = 3, desc: str = "", amp_dtype=None,
                       verbose: bool = False, **kwargs) -> Timing:
    """Backward time alone: one forward, then repeated backward passes through the retained graph with fixed
    random output gradients (inputs that require grad get theirs; so do the module's parameters)."""
    device = _device_of(args)
    with _autocast(device.type, amp_dtype):
        outs = _outputs(fn(*args, **kwargs))
    grads = [torch.randn_like(o) for o in outs]

    def run():
        with backward_on_this_thread():
            torch.autograd.backward(outs, grads, retain_graph=True)

    timing = time_fn(run, device=device, warmup=warmup, repeats=repeats)
    if verbose:
        log.info("%s backward: %.3f ms", desc, timing.median_ms)
    return timing


def benchmark_fwd_bwd(fn: Callable, *args, repeats: int = 10, warmup: int = 3, desc: str = "", amp_dtype=None,
                      verbose: bool = False, **kwargs) -> Timing:
    """Forward + backward time of ``fn`` (a fresh graph each call)."""
    device = _device_of(args)
    grads: list[torch.Tensor] = []

    def run():
        with _autocast(device.type, amp_dtype):
            outs = _outputs(fn(*args, **kwargs))
        if not grads:
            grads.extend(torch.randn_like(o) for o in outs)
        with backward_on_this_thread():
            torch.autograd.backward(outs, grads)

    timing = time_fn(run, device=device, warmup=warmup, repeats=repeats)
    if verbose:
        log.info("%s forward+backward: %.3f ms", desc, timing.median_ms)
    return timing


def benchmark_all(fn: Callable, *args, **kwargs) -> dict[str, Timing]:
    """Forward, backward and forward + backward timings of ``fn``."""
    return {"forward": benchmark_forward(fn, *args, **kwargs), "backward": benchmark_backward(fn, *args, **kwargs),
            "fwd_bwd": benchmark_fwd_bwd(fn, *args, **kwargs)}


def benchmark_memory(fn: Callable, *args, backward: bool = True, desc: str = "", amp_dtype=None, verbose: bool = False,
                     **kwargs) -> int:
    """Peak memory of one call (forward, and backward when ``backward``), in bytes above what was allocated
    before it: CUDA allocator statistics on a GPU; on the CPU the process's resident-set high-water mark
    growth (coarse: it never goes down, so only a first, larger call shows)."""
    device = _device_of(args)

    def run():
        with _autocast(device.type, amp_dtype):
            out = fn(*args, **kwargs)
        if backward:
            outs = _outputs(out)
            torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    if verbose:
        log.info("%s peak memory: %.3f GiB", desc, peak / 2**30)
    return peak
