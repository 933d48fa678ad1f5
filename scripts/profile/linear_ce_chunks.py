"""Fused linear + cross-entropy: forward + backward time and peak memory against the token chunk size, with
torch.compile of the unfused loss (bench ops' peer) in the same process, at bench ops' shape (16k tokens,
H 4096, V 128k, bf16).

Why: the chunk loop accumulates the (V, H) weight gradient once per chunk, a read and a write of 1 GB at this
shape that the GEMMs do not hide, so fewer, larger chunks trade memory (one chunk of logits) for time. The
sides are timed in two interleaved rounds (a drifting clock hits each alike), the median of 7 sync'd steps
each, as ``bench ops`` times them.

    PYTHONPATH=.:kernels python scripts/profile/linear_ce_chunks.py   # on a CUDA GPU
"""

import torch
import torch.nn.functional as F

from flash_kernels import linear_cross_entropy
from flash_models.bench.harness import peak_memory_bytes, time_cuda
from flash_models.bench.ops import _fwd_bwd_step

N, H, V = 16384, 4096, 128256
CHUNKS = (2048, 4096, 8192)


def main():
    print(torch.cuda.get_device_name())
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    sides = {f"ours, chunk {c}": (lambda c=c: linear_cross_entropy(hidden, weight, labels, chunk_size=c)) for c in CHUNKS}
    sides["torch.compile (unfused)"] = torch.compile(lambda: F.cross_entropy(F.linear(hidden, weight).float(), labels))
    steps = {name: _fwd_bwd_step(fn, [hidden, weight]) for name, fn in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(2):
        for name, step in steps.items():
            times[name].append(time_cuda(step, warmup=2, repeats=7).median_ms)
    peaks = {name: peak_memory_bytes(step) / 2**30 for name, step in steps.items()}
    compiled = min(times["torch.compile (unfused)"])
    print("| side | f+b ms (two rounds) | compile / side (best round) | peak GiB |")
    print("|---|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms[0]:.2f}, {ms[1]:.2f} | {compiled / min(ms):.3f} | {peaks[name]:.2f} |")


if __name__ == "__main__":
    main()
