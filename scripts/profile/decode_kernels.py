"""The kernels of one greedy decode step (replayed from its CUDA graph), per kernel name, for a model preset.

    PYTHONPATH=.:kernels python scripts/profile/decode_kernels.py [gpt2-124m|llama-1.1b] [batch] [pdl]   # on a CUDA GPU

With "pdl", the decode step runs with programmatic dependent launch (the ``programmatic_launch`` setting),
without it with plain launches. Besides each kernel's own time, the time each adds to the timeline (from its
predecessor's end to its own: under PDL a kernel's duration includes its wait), and an excerpt of one step.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_models.bench.generate import MODELS
from flash_models.checkpoint import create_model
from kernel_table import critical_path_per_step, kernels_per_step, print_timeline, print_top  # sibling module


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2-124m"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    pdl = len(sys.argv) > 3 and sys.argv[3] == "pdl"
    preset, overrides = MODELS[name]
    model = create_model(preset, dtype=torch.bfloat16, device="cuda", **overrides).eval()
    ids = torch.randint(100, 20000, (batch, 128), device="cuda")
    generate = lambda n: model.generate(ids, max_new_tokens=n, eos_token_id=[], programmatic_launch=pdl)  # noqa: E731
    generate(64)  # capture and tune outside the profile
    torch.cuda.synchronize()
    steps = 32
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(steps + 1)
        torch.cuda.synchronize()
    kernels = kernels_per_step(prof, steps, name_chars=90)
    total = sum(t for _, t in kernels.values())
    launches = sum(n for n, _ in kernels.values())
    mode = " with PDL" if pdl else ""
    print(f"{name} batch {batch}{mode}: {launches:.0f} kernels and {total / 1e3:.3f} ms of kernel time per step "
          f"(prefill included, spread over {steps} steps)")
    print_top(kernels)
    added, timeline = critical_path_per_step(prof, steps, name_chars=90)
    added_ms = sum(t for _, t in added.values()) / 1e3
    print(f"time added to the timeline per step (gaps between steps included): {added_ms:.3f} ms")
    print_top(added)
    print("one decode step's excerpt, from the middle of the run:")
    print_timeline(timeline, len(timeline) // 2, 24)


if __name__ == "__main__":
    main()
