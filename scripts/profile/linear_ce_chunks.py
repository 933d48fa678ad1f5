"""Fused linear + cross-entropy: forward + backward time and peak memory against the token chunk size, with
torch.compile of the unfused loss (bench ops' peer) in the same process, at bench ops' shape (16k tokens,
H 4096, V 128k, bf16).

Why: the chunk loop accumulates the (V, H) weight gradient once per chunk, a read and a write of 1 GB at this
shape that the GEMMs do not hide, so fewer, larger chunks trade memory (one chunk of logits) for time. These
steps are long (~80 ms) and heavy enough for the GPU's clock to drift between rounds of one side (up to 5%
on an H100), so the sides alternate step by step, in an order reversed every round, each step timed by CUDA
events; the table gives medians.

    PYTHONPATH=.:kernels python scripts/profile/linear_ce_chunks.py [CHUNK ...]   # on a CUDA GPU
"""

import statistics
import sys

import torch
import torch.nn.functional as F

from flash_kernels import linear_cross_entropy
from flash_models.bench.harness import peak_memory_bytes
from flash_models.bench.ops import _fwd_bwd_step

N, H, V = 16384, 4096, 128256
CHUNKS = tuple(int(c) for c in sys.argv[1:]) or (2048, 4096, 8192)
ROUNDS = 12


def step_ms(step) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    step()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def main():
    print(torch.cuda.get_device_name())
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    sides = {f"ours, chunk {c}": (lambda c=c: linear_cross_entropy(hidden, weight, labels, chunk_size=c)) for c in CHUNKS}
    sides["torch.compile (unfused)"] = torch.compile(lambda: F.cross_entropy(F.linear(hidden, weight).float(), labels))
    steps = {name: _fwd_bwd_step(fn, [hidden, weight]) for name, fn in sides.items()}
    for step in steps.values():  # compiles, and picks the cuBLASLt algorithms (their scratch outputs not in the peaks)
        step()
    peaks = {name: peak_memory_bytes(step) / 2**30 for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(ROUNDS):
        for name, step in (list(steps.items()) if r % 2 == 0 else list(steps.items())[::-1]):
            times[name].append(step_ms(step))
    compiled = statistics.median(times["torch.compile (unfused)"])
    print(f"| side | f+b ms, median of {ROUNDS} (min - max) | compile / side | peak GiB |")
    print("|---|---|---|---|")
    for name, ms in times.items():
        median = statistics.median(ms)
        print(f"| {name} | {median:.2f} ({min(ms):.2f} - {max(ms):.2f}) | {compiled / median:.3f} | {peaks[name]:.2f} |")


if __name__ == "__main__":
    main()
