"""Per-kernel GPU time from a torch.profiler run, shared by the profile scripts that print kernel tables."""

import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile


def kernels_per_step(prof, steps: int, name_chars: int = 100) -> dict[str, list[float]]:
    """{kernel name: [launches per step, us per step]} over the CUDA kernels of a run of ``steps`` steps."""
    kernels = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels[e.name[:name_chars]]
            k[0] += 1 / steps
            k[1] += (e.time_range.end - e.time_range.start) / steps
    return kernels


def print_top(kernels: dict[str, list[float]], n: int = 25) -> None:
    """The ``n`` kernels with the most time per step."""
    for name, (launches, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:n]:
        print(f"  {us:8.1f} us/step  {launches:5.1f}/step  {name}")


def time_and_profile(fn, steps: int = 5) -> tuple[float, dict[str, list[float]]]:
    """(wall ms per step, ``kernels_per_step``) of ``fn``: warmed up, timed, then profiled."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return wall_ms, kernels_per_step(prof, steps)


def print_step(title: str, wall_ms: float, kernels: dict[str, list[float]]) -> None:
    """A step's wall time, its kernel time (their gap is host overhead), launches, and its top kernels."""
    total_us = sum(t for _, t in kernels.values())
    print(f"\n{title}: {wall_ms:.2f} ms wall, {total_us / 1e3:.2f} ms of kernels, "
          f"{sum(n for n, _ in kernels.values()):.0f} launches per step")
    print_top(kernels)
