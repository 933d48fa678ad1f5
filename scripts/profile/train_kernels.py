"""One eager training step, kernel by kernel, each kernel attributed to the op (and our code) that launched it:
where a `bench train` step's GPU time goes. Then where the GPU waits: the step's wall time against its kernel
time, and the longest idle gaps between two steps' kernels, named by the kernels around them (a gap after a
kernel whose result the host reads is a sync; gaps spread everywhere mean the host cannot launch fast enough).

    PYTHONPATH=.:kernels python scripts/profile/train_kernels.py [case] [side]   # a bench train case and side: gpt2 loop:ours; CUDA
"""

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flash_models.bench.train import CASES, step_for
from kernel_table import print_gaps, print_host_ops


def _our_frames(event) -> str:
    frames = [f for f in (event.stack or []) if "flash_models" in f or "flash_kernels" in f]
    return " < ".join(f.split("/")[-1] for f in frames[:3])


def _owner(event) -> str:
    """The nearest ancestor that is not an aten:: op: the autograd node or module that launched the kernel."""
    while event is not None and event.name.startswith("aten::"):
        event = event.cpu_parent
    return event.name[:60] if event is not None else "-"


def main():
    case = CASES[sys.argv[1] if len(sys.argv) > 1 else "gpt2"]
    side = sys.argv[2] if len(sys.argv) > 2 else "loop:ours"
    step = step_for(side, case, torch.device("cuda"))
    for i in range(3):  # autotune, allocate the optimizer state
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        step(3)
        torch.cuda.synchronize()
    per_key = collections.defaultdict(lambda: [0, 0.0])
    total = 0.0
    for event in prof.events():
        if event.device_type.name != "CPU" or not event.kernels:
            continue
        for kernel in event.kernels:
            key = (kernel.name[:70], event.name, str(event.input_shapes)[:80], _owner(event), _our_frames(event)[:200])
            per_key[key][0] += 1
            per_key[key][1] += kernel.duration
            total += kernel.duration
    print(f"{case.preset} {side}: total kernel time {total / 1000:.2f} ms")
    for (kernel, op, shapes, owner, frames), (count, us) in sorted(per_key.items(), key=lambda kv: -kv[1][1])[:70]:
        print(f"{us / 1000:7.3f} ms x{count:3d} | {kernel} | {op} {shapes} | {owner} | {frames}")
    print_idle(step)


def print_idle(step, steps: int = 3) -> None:
    """Wall time per step of back-to-back steps (no sync between them), then a profiled run of as many: the
    host's time by op and the GPU's idle gaps."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    print(f"\nwall {(time.perf_counter() - start) * 1e3 / steps:.2f} ms per step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    print_host_ops(prof, steps)
    print_gaps(prof, steps)


if __name__ == "__main__":
    main()
