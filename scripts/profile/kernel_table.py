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


def critical_path_per_step(prof, steps: int, name_chars: int = 100) -> tuple[dict[str, list[float]], list[tuple]]:
    """Per kernel name, [launches per step, us per step of the timeline it adds]: with programmatic dependent
    launch a kernel starts while its predecessor runs and waits in-kernel, so its own duration overstates its
    cost; what it adds is the time from its predecessor's end to its own (one stream: they end in order).
    Also the ordered (name, start us, duration us, added us) of every kernel, for a timeline excerpt."""
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.end)
    kernels = collections.defaultdict(lambda: [0.0, 0.0])
    timeline, prev_end = [], None
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        added = end - (start if prev_end is None else prev_end)  # a gap before it (its launch) counts too
        prev_end = end
        k = kernels[e.name[:name_chars]]
        k[0] += 1 / steps
        k[1] += added / steps
        timeline.append((e.name[:name_chars], start, end - start, added))
    return kernels, timeline


def print_timeline(timeline: list[tuple], first: int, count: int) -> None:
    """``count`` kernels of the timeline from index ``first``: start (relative), duration, time added."""
    t0 = timeline[first][1]
    for name, start, duration, added in timeline[first:first + count]:
        print(f"  {start - t0:8.1f} +{duration:6.1f} us  adds {added:6.1f} us  {name[:60]}")


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


def print_host_ops(prof, steps: int, top: int = 20) -> None:
    """The host's self time per step by op (the profiler adds its own cost to each)."""
    print("\nthe host's time per step by op (self time; the profiler adds its own cost to each):")
    host = sorted(((e.key, e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()),
                  key=lambda r: -r[2])
    for key, count, us in host[:top]:
        print(f"  {us / 1e3:7.3f} ms  x{count:5.0f}  {key[:90]}")


def print_gaps(prof, steps: int, top: int = 20) -> None:
    """The GPU's kernel time and idle time per step, and the longest idle gaps, named by the kernels around
    them: a gap after a kernel whose result the host reads is a sync; gaps spread everywhere mean the host
    cannot launch fast enough."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels) / steps / 1e3
    gaps, end = [], None
    for prev, e in zip([None] + kernels, kernels):
        if end is not None and e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev.name[:50], e.name[:50]))
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    idle = sum(g[0] for g in gaps) / steps / 1e3
    print(f"\nkernels {busy:.2f} ms per step; GPU idle {idle:.2f} ms per step (profiled), in {len(gaps) / steps:.0f} "
          f"gaps; the longest over {steps} steps:")
    for us, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {us:8.1f} us  after {before}  before {after}")
