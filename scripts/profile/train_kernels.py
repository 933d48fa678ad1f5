"""One eager training step, kernel by kernel, each kernel attributed to the op (and our code) that launched it:
where a `bench train` step's GPU time goes.

    PYTHONPATH=.:kernels python scripts/profile/train_kernels.py [case] [side]   # a bench train case and side: gpt2 loop:ours; CUDA
"""

import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_models.bench.train import CASES, step_for


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


if __name__ == "__main__":
    main()
