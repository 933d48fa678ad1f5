"""Run a backward pass on the calling thread: what the Trainer and the benchmarks do, and what a custom loop over
our models should do too.

Why: on a CUDA device, torch's autograd engine runs the backward on a per-device worker thread. Every Python
node (our kernels' autograd Functions, saved-tensor hooks) then takes the GIL from that thread, which costs
tens of microseconds per node on top of the work, and a step has hundreds of such nodes. Measured on an H200
(`flash-models bench train` and `bench bert`, the backward on the calling thread against the worker): GPT-2 124M
eager training step 34-37 ms against 52-60 ms, BERT-base at 512 tokens 29-30 against 41 ms; HF's models, whose
backward is native code, were level (80.1 vs 80.2 ms). `scripts/profile/host_cost.py` shows the cost per call
on both threads. The worker threads only buy overlap between several devices' backward work, which one model
on one device does not have. Not for DDP yet: on two H200s, DDP (bf16 compression hook) fell from 656k to 408k
tokens/s with it, so the Trainer uses it in single-process runs only.

    with backward_on_this_thread():
        loss.backward()
"""

import torch


def backward_on_this_thread() -> torch.autograd.set_multithreading_enabled:
    """Use in a ``with`` statement (torch's switch takes effect when made and is restored on exit; it is
    thread-local): ``backward()`` inside runs on the calling thread."""
    return torch.autograd.set_multithreading_enabled(False)
