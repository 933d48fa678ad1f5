"""Batch-1 projections of LLaMA-1.1B: cuBLAS (F.linear) vs our gemv kernel, in us per call and as a fraction of
the device copy bandwidth (weight bytes / time). Each side runs as 20 back-to-back calls replayed from one CUDA
graph, as a decode step runs them, so host launch cost is out and per-kernel ramp-up is in.

    PYTHONPATH=.:kernels python scripts/profile/gemv_sweep.py   # on a CUDA GPU
"""

import torch
import torch.nn.functional as F

from flash_kernels import gemv
from flash_models.bench.harness import measure_copy_bandwidth, time_cuda

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate/up": (11264, 2048), "down": (2048, 5632),
          "lm head": (32000, 2048)}
CALLS = 20


def per_call_us(fn) -> float:
    fn()  # autotune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return time_cuda(graph.replay, repeats=30).median_ms * 1e3 / CALLS


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s")
    print("| projection | N x K | cuBLAS us | cuBLAS frac | ours us | ours frac | ours vs cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, (n, k) in SHAPES.items():
            x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            cublas = per_call_us(lambda: F.linear(x, weight))
            ours = per_call_us(lambda: gemv(x, weight, backend="triton"))
            frac = lambda us: n * k * 2 / (us * 1e-6) / copy_bw  # noqa: E731  (read-only: weight bytes)
            print(f"| {name} | {n} x {k} | {cublas:.2f} | {frac(cublas):.2f} | {ours:.2f} | {frac(ours):.2f} "
                  f"| {cublas / ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
