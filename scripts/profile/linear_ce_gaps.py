"""Fused linear + cross-entropy timed as ``bench ops`` times it (calls back to back, no synchronize between
them), with the GPU's idle gaps inside the steps: where ours loses time against torch.compile of the unfused
loss when its kernels alone add up to less.

Why: by kernel time the two were level (0.994x, session 21), by bench ops' wall time ours was behind (77.2
against 74.6, session 30). The difference is GPU time that no kernel uses (a host stall, a synchronizing
allocation) or kernels that ran slower in the timed steps than in the profiled ones; this script prints both:
per side, the wall time of back-to-back steps, the kernel time in a profiled run of the same steps, and the
largest idle gaps with the kernels around them.

    PYTHONPATH=.:kernels:scripts/profile python scripts/profile/linear_ce_gaps.py   # on a CUDA GPU
"""

import torch
from kernel_table import critical_path_per_step  # this folder's sibling script
from torch.profiler import ProfilerActivity, profile

from flash_models.bench.harness import time_cuda
from flash_models.bench.ops import _fwd_bwd_step, linear_cross_entropy_cases

STEPS = 5
GAP_US = 30.0


def idle_gaps(prof) -> tuple[float, list[tuple[float, str, str]]]:
    """(kernel-busy us, [(gap us, kernel before, kernel after)]) over the profiled run's CUDA kernels, one
    stream: from ``critical_path_per_step``'s timeline, where a kernel's added time beyond its own duration is
    the idle gap before it."""
    _, timeline = critical_path_per_step(prof, steps=1)
    busy = sum(duration for _, _, duration, _ in timeline)
    gaps = [(added - duration, before[0][:50], name[:50])
            for before, (name, _, duration, added) in zip(timeline, timeline[1:]) if added - duration > GAP_US]
    return busy, gaps


def main():
    print(torch.cuda.get_device_name())
    (case,) = linear_cross_entropy_cases(compile_peer=True)
    sides = {name: _fwd_bwd_step(fn, case.inputs) for name, fn in case.impls.items() if name != "torch eager"}
    for rnd in range(2):
        for name, step in (sides.items() if rnd == 0 else reversed(sides.items())):
            timing = time_cuda(step, repeats=STEPS, back_to_back=True)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(STEPS):
                    step()
                torch.cuda.synchronize()
            busy, gaps = idle_gaps(prof)
            gap_total = sum(g for g, _, _ in gaps)
            print(f"\nround {rnd} {name}: back-to-back median {timing.median_ms:.2f} ms (min {timing.min_ms:.2f}); "
                  f"profiled: kernels {busy / 1e3 / STEPS:.2f} ms per step, {len(gaps) / STEPS:.1f} gaps > "
                  f"{GAP_US:.0f} us per step totalling {gap_total / 1e3 / STEPS:.2f} ms")
            for gap, before, after in sorted(gaps, reverse=True)[:8]:
                print(f"  {gap:9.1f} us idle  after {before}  before {after}")


if __name__ == "__main__":
    main()
