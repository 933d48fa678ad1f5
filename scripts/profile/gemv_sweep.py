"""Batch-1 projections of LLaMA-1.1B: cuBLAS (F.linear) vs our gemv kernel, in us per call and as a fraction of
the device copy bandwidth (weight bytes / time); then each projection with the ops gemv can fuse into it (the
RMSNorm before qkv and gate/up, SwiGLU before down, the residual add after o and down), run as the unfused
kernels a decode layer launches today vs one fused gemv call. Each side runs as 20 back-to-back calls replayed
from one CUDA graph, as a decode step runs them, so host launch cost is out and per-kernel ramp-up and the gaps
between a graph's kernels are in. Each call reads its own weight copy, as each layer of a decode step does: with
one shared weight the 20 calls would read L2 (50 MB on an H100), not HBM.

    PYTHONPATH=.:kernels python scripts/profile/gemv_sweep.py   # on a CUDA GPU
"""

import torch
import torch.nn.functional as F

from flash_kernels import gemv, rms_norm, swiglu
from flash_models.bench.harness import measure_copy_bandwidth, time_cuda

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate/up": (11264, 2048), "down": (2048, 5632),
          "lm head": (32000, 2048)}
# One decode layer's projections with what gemv fuses into each (see flash_kernels/gemv.py).
FUSED = {"norm + qkv": ("qkv", "norm"), "o + add": ("o", "residual"), "norm + gate/up": ("gate/up", "norm"),
         "swiglu + down + add": ("down", "swiglu")}
CALLS = 20
EPS = 1e-5  # LLaMA's rms_norm_eps
DTYPE = torch.bfloat16


def per_call_us(fn) -> float:
    """fn makes CALLS calls, one per weight copy."""
    fn()  # autotune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, repeats=30).median_ms * 1e3 / CALLS


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device="cuda", dtype=DTYPE) for _ in range(CALLS)]


def unfused_and_fused(fusion: str, weight: torch.Tensor):
    """(what a decode layer runs today, the one gemv call replacing it) for one weight copy."""
    n, k = weight.shape
    x = torch.randn(1, 1, 2 * k if fusion == "swiglu" else k, device="cuda", dtype=DTYPE)  # swiglu: [gate; up]
    residual = torch.randn(1, 1, n, device="cuda", dtype=DTYPE)
    norm_weight = torch.randn(k, device="cuda", dtype=DTYPE)
    if fusion == "norm":
        return (lambda: F.linear(rms_norm(x, norm_weight, eps=EPS), weight),
                lambda: gemv(x, weight, norm_weight=norm_weight, norm_eps=EPS, backend="triton"))
    if fusion == "residual":
        return lambda: F.linear(x, weight) + residual, lambda: gemv(x, weight, residual=residual, backend="triton")
    return (lambda: F.linear(swiglu(x), weight) + residual,
            lambda: gemv(x, weight, residual=residual, swiglu=True, backend="triton"))


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s")
    print("| projection | N x K | cuBLAS us | cuBLAS frac | ours us | ours frac | ours vs cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, (n, k) in SHAPES.items():
            x = torch.randn(1, 1, k, device="cuda", dtype=DTYPE)
            weights = weight_copies(n, k)
            cublas = per_call_us(lambda: [F.linear(x, weight) for weight in weights])
            ours = per_call_us(lambda: [gemv(x, weight, backend="triton") for weight in weights])
            frac = lambda us: n * k * 2 / (us * 1e-6) / copy_bw  # noqa: E731  (read-only: weight bytes)
            print(f"| {name} | {n} x {k} | {cublas:.2f} | {frac(cublas):.2f} | {ours:.2f} | {frac(ours):.2f} "
                  f"| {cublas / ours:.2f} |", flush=True)

        print("\n| layer op | N x K | unfused us | fused gemv us | saved us | unfused vs fused |")
        print("|---|---|---|---|---|---|")
        for name, (projection, fusion) in FUSED.items():
            n, k = SHAPES[projection]
            pairs = [unfused_and_fused(fusion, weight) for weight in weight_copies(n, k)]
            unfused = per_call_us(lambda: [run() for run, _ in pairs])
            fused = per_call_us(lambda: [run() for _, run in pairs])
            print(f"| {name} | {n} x {k} | {unfused:.2f} | {fused:.2f} | {unfused - fused:.2f} "
                  f"| {unfused / fused:.2f} |", flush=True)


if __name__ == "__main__":
    main()
