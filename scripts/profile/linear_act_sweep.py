"""An encoder MLP's first projection + activation: cuBLAS's GEMM + bias then torch's GELU, or then ours (what
"auto" ran before session 15), against ``flash_kernels.linear_act`` (one persistent TMA Triton GEMM with the
bias and the erf GELU in its epilogue; its largest difference from cuBLAS + our GELU is printed),
graph-replayed so host cost is out, bf16; then the host cost of one eager call of each (a tiny shape, so the
GPU waits on the host). BERT at 0% padding spends 0.86 of 6.6 ms of kernels in GELU (docs/benchmarks.md,
BERT, session 8).

    PYTHONPATH=.:kernels python scripts/profile/linear_act_sweep.py   # on a CUDA GPU
"""

import torch
import torch.nn.functional as F
from gemm_rows import graphed_us  # this folder's sibling scripts
from host_cost import host_us

from flash_kernels import gelu, linear_act

# (name, M tokens, K hidden, N intermediate)
SHAPES = [("bert-base 128x128", 16384, 768, 3072), ("vit-b16 64 images", 64 * 197, 768, 3072),
          ("bert-large 16k", 16384, 1024, 4096), ("bert-large packed", 9011, 1024, 4096),
          ("vit-l16 32 images", 32 * 197, 1024, 4096)]


def main():
    print(torch.cuda.get_device_name())
    print("| shape | M x K -> N | GEMM+bias us | + torch GELU us | + our GELU us | linear_act us | "
          "(+ our GELU) / linear_act | max abs diff, linear_act vs + our GELU |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, m, k, n in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            pre = F.linear(x, weight, bias)
            gemm_us = graphed_us(lambda: F.linear(x, weight, bias))
            torch_us = graphed_us(lambda: F.gelu(F.linear(x, weight, bias)))
            ours_us = graphed_us(lambda: gelu(F.linear(x, weight, bias)))
            fused_us = graphed_us(lambda: linear_act(x, weight, bias, activation="gelu", backend="triton"))
            diff = (linear_act(x, weight, bias, backend="triton").float() - gelu(pre).float()).abs().max().item()
            print(f"| {name} | {m} x {k} -> {n} | {gemm_us:.1f} | {torch_us:.1f} | {ours_us:.1f} | {fused_us:.1f} "
                  f"| {ours_us / fused_us:.2f} | {diff:.3g} |", flush=True)
        shapes = ((8, 64), (128, 64), 128)
        x, weight, bias = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes)
        torch_us = host_us(lambda: F.gelu(F.linear(x, weight, bias)))
        fused_us = host_us(lambda: linear_act(x, weight, bias, activation="gelu", backend="triton"))
        print(f"host us per eager call (8 x 64 -> 128): F.linear + F.gelu {torch_us:.1f}, linear_act {fused_us:.1f}")


if __name__ == "__main__":
    main()
