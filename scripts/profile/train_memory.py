"""What is alive at the peak of one training step, grouped by the code that allocated it.

Replays the CUDA caching allocator's trace of one step (after a first step has built the optimizer state) to
find the moment of the peak, then sums the live allocations by their innermost project frames.

    PYTHONPATH=.:kernels python scripts/profile/train_memory.py [case] [side]   # a bench train case and side: llama-1b loop:ours; CUDA
"""

import sys
from collections import defaultdict

import torch

from flash_models.bench.train import CASES, step_for

MiB = 2**20


def where(frames) -> str:
    """The two innermost frames inside this project (or torch's autograd engine when there are none)."""
    ours = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames
            if "flash_models" in f["filename"] or "flash_kernels" in f["filename"] or "transformers" in f["filename"]]
    return " <- ".join(ours[:2]) if ours else "(no project frame: autograd engine / allocator)"


def main():
    case = CASES[sys.argv[1] if len(sys.argv) > 1 else "llama-1b"]
    side = sys.argv[2] if len(sys.argv) > 2 else "loop:ours"
    step = step_for(side, case, torch.device("cuda"))
    step(0)  # optimizer state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step(1)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    trace = [e for t in snapshot["device_traces"] for e in t if e["action"] in ("alloc", "free_completed")]
    live, now, best, at_peak = {}, base, base, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        else:  # also blocks allocated before the trace started (the previous step's gradients, ...)
            live.pop(e["addr"], None)
            now -= e["size"]
        if now > best:
            best, at_peak = now, dict(live)
    print(f"{case.preset} {side}: before the step {base / MiB:.0f} MiB (weights, grads, optimizer state), "
          f"traced peak {best / MiB:.0f} MiB, max_memory_allocated {peak / MiB:.0f} MiB")
    groups = defaultdict(lambda: [0, 0])
    for e in at_peak.values():
        g = groups[where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    print(f"alive at the peak beyond the step's start: {sum(g[0] for g in groups.values()) / MiB:.0f} MiB")
    for name, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {size / MiB:9.1f} MiB  {count:5d} x  {name}")


if __name__ == "__main__":
    main()
