"""Norm forward kernel time vs warps, by CUDA-graph replay (GPU time only), for the
residual-add + norm of a block: post-norm inference (the stream not written: x, residual read, y written) and
pre-norm (the stream written too). Patches layer_norm._fwd_plan; the shipped plan is timed last. Also times
torch's add + F.layer_norm, and reports TB/s against the bytes each call must move.

    PYTHONPATH=.:kernels python scripts/profile/norm_fwd_sweep.py [M,N ...]   # on a CUDA GPU
"""

import sys

import torch
import torch.nn.functional as F

import flash_kernels
from gemm_rows import graphed_us  # this folder's sibling module

ln = sys.modules["flash_kernels.layer_norm"]
SHAPES = [(16384, 768), (9216, 1024), (16384, 1024), (16384, 2048), (16384, 4096)]
WARPS = (1, 2, 4, 8, 16)


def main():
    shapes = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or SHAPES
    print(torch.cuda.get_device_name())
    print("| M x N | kind | shipped us | TB/s | best: warps, us | TB/s | 2nd, 3rd | torch add+LN us |")
    print("|---|---|---|---|---|---|---|---|")
    shipped_plan = ln._fwd_plan
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for kind, prenorm in (("post-norm, inference", False), ("pre-norm", True)):
            tensors = 4 if prenorm else 3
            tbps = lambda us: tensors * m * n * 2 / us / 1e6  # noqa: E731

            def call():
                return flash_kernels.layer_norm(x, w, b, residual=r, prenorm=prenorm, backend="triton")

            results = []
            with torch.no_grad():
                block, single = shipped_plan(n)[:2]
                for warps in WARPS:
                    ln._fwd_plan = lambda _n, c=(block, single, warps): c
                    results.append((graphed_us(call), warps))
                ln._fwd_plan = shipped_plan
                shipped = graphed_us(call)
                torch_us = graphed_us(lambda: F.layer_norm(x + r, (n,), w, b))
            results.sort()
            best, others = results[0], results[1:3]
            print(f"| {m} x {n} | {kind} | {shipped:.1f} | {tbps(shipped):.2f} | {best[1]}, {best[0]:.1f} | "
                  f"{tbps(best[0]):.2f} | " + ", ".join(f"{w_}, {us:.1f}" for us, w_ in others) + f" | {torch_us:.1f} |")


if __name__ == "__main__":
    main()
