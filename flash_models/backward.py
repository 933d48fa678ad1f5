"""Run a backward pass on the calling thread, as our models' training forwards arrange by themselves.

Why: on a CUDA device, torch's autograd engine runs the backward on a per-device worker thread. Every Python
node (our kernels' autograd Functions, saved-tensor hooks) then takes the GIL from that thread, which costs
tens of microseconds per node on top of the work, and a step has hundreds of such nodes. Measured on an H200
(`flash-models bench train` and `bench bert`, the backward on the calling thread against the worker): GPT-2 124M
eager training step 34-37 ms against 52-60 ms, BERT-base at 512 tokens 29-30 against 41 ms; HF's models, whose
backward is native code, were level (80.1 vs 80.2 ms). `scripts/profile/host_cost.py` shows the cost per call
on both threads. The worker threads only buy overlap between several devices' backward work, which one model
on one device does not have. Not for DDP yet: on two H200s, DDP (bf16 compression hook) fell from 656k to 408k
tokens/s with it, so the Trainer uses it in single-process runs only.

So in one process a forward of our models that records gradients on a CUDA device switches the calling thread to
it (``backward_on_this_thread_from_now``, called by every model's public forward): a plain loop's
``loss.backward()``, transformers' Trainer and TRL then get it without a wrapper of their own. The switch is
torch's thread-local ``set_multithreading_enabled(False)``, left on: it changes where the backward runs, never
what it computes. To keep the worker threads for one backward, wrap that call in
``torch.autograd.set_multithreading_enabled(True)``. ``backward_on_this_thread()`` is the same switch as a context
manager, for a backward of models other than ours:

    with backward_on_this_thread():
        loss.backward()
"""

import torch
import torch.distributed as dist


def backward_on_this_thread() -> torch.autograd.set_multithreading_enabled:
    """Use in a ``with`` statement (torch's switch takes effect when made and is restored on exit; it is
    thread-local): ``backward()`` inside runs on the calling thread."""
    return torch.autograd.set_multithreading_enabled(False)


def backward_on_this_thread_from_now(module: torch.nn.Module) -> None:
    """Called by our models' public forwards: when this forward records gradients, runs on a CUDA device and is
    not part of a multi-process job (the DDP measurement above), later backward calls on this thread run on it
    (module docstring). Nothing under torch.compile, whose traced graph must not hold the switch."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not torch._C._is_multithreading_enabled():
        return
    if _on_cuda(module) and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        torch.autograd.set_multithreading_enabled(False)


def _on_cuda(module: torch.nn.Module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.is_cuda
