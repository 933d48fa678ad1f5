"""GEMM + bias time against the row count M, at BERT-large's four linear shapes: torch's F.linear (cuBLASLt, its
heuristic's first answer) against our ``fused_dense`` (cuBLASLt, the fastest of up to 8 of the heuristic's
answers, timed at the first call), each replayed from a CUDA graph of 10 calls so host cost is out.

Why: graphed BERT-large inference at 512 / 45% padding ran its GEMMs over a bucket of 9216 packed tokens 15%
slower than eager over the exact 9011 (docs/benchmarks.md, session 9): cuBLAS picks other kernels for row
counts that are multiples of 128. If the timed choice recovers that, the graphed paths' linears should take it.

    PYTHONPATH=.:kernels python scripts/profile/gemm_rows.py   # on a CUDA GPU (builds fused_dense on first use)
"""

import torch
import torch.nn.functional as F

from flash_kernels import fused_dense
from flash_models.bench.harness import time_cuda

SHAPES = [(1024, 3072), (1024, 4096), (4096, 1024), (1024, 1024)]  # (K, N): qkv, fc1, fc2, out
ROWS = [9011, 9088, 9216, 8704, 16384]
CALLS = 10


def graphed_us(fn) -> float:
    """us per call of fn replayed CALLS times from one graph (warmed up, and autotuned, on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return time_cuda(graph.replay, repeats=30).median_ms * 1e3 / CALLS


def main():
    print(torch.cuda.get_device_name())
    print("| M | K -> N | F.linear us | fused_dense us | F.linear / fused_dense |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for m in ROWS:
            for k, n in SHAPES:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                torch_us = graphed_us(lambda: F.linear(x, weight, bias))
                ours_us = graphed_us(lambda: fused_dense(x, weight, bias, backend="cuda"))
                print(f"| {m} | {k} -> {n} | {torch_us:.1f} | {ours_us:.1f} | {torch_us / ours_us:.2f} |", flush=True)


if __name__ == "__main__":
    main()
