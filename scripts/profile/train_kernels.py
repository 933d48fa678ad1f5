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


def print_idle(step, steps: int = 3, top: int = 20) -> None:
    """Wall time per step of back-to-back steps (no sync between them) against their kernel time, the host's
    time by op, and the longest gaps in the GPU's timeline."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    print(f"\nthe host's time per step by op (self time; the profiler adds its own cost to each):")
    host = sorted(((e.key, e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()),
                  key=lambda r: -r[2])
    for key, count, us in host[:top]:
        print(f"  {us / 1e3:7.3f} ms  x{count:5.0f}  {key[:90]}")
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels) / steps / 1e3
    gaps, end = [], None
    for prev, e in zip([None] + kernels, kernels):
        if end is not None and e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev.name[:50], e.name[:50]))
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    idle = sum(g[0] for g in gaps) / steps / 1e3
    print(f"\nwall {wall_ms:.2f} ms per step; kernels {busy:.2f} ms; GPU idle {idle:.2f} ms per step (profiled), "
          f"in {len(gaps) / steps:.0f} gaps; the longest over {steps} steps:")
    for us, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {us:8.1f} us  after {before}  before {after}")


if __name__ == "__main__":
    main()
