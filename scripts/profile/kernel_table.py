"""Per-kernel GPU time from a torch.profiler run, shared by the profile scripts that print kernel tables."""

import collections


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
