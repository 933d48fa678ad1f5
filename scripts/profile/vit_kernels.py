"""Kernel time of one ViT step, ours vs timm eager, per kernel name: where `bench vit` loses or wins.

    PYTHONPATH=.:kernels python scripts/profile/vit_kernels.py [vit-b16] [training|inference] [batch]   # on a CUDA GPU

Prints, per side, the wall time of a step, the GPU kernel time inside it (their gap is host overhead) and the
25 most expensive kernels per step.
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flash_models.bench.vit import _step_fns, build_models
from kernel_table import kernels_per_step, print_top  # this folder's sibling module


def kernel_table(fn, steps: int = 5):
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


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "vit-b16"
    mode = sys.argv[2] if len(sys.argv) > 2 else "training"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    device = torch.device("cuda")
    models = build_models(name, dtype=torch.bfloat16, device=device, dry_run=False, compile_peer=False)
    images = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (batch,), device=device)
    for impl, model in models.items():
        model.train(mode == "training")
        inference, training = _step_fns(model, images, labels, impl=impl)
        wall_ms, kernels = kernel_table(training if mode == "training" else inference)
        total_us = sum(t for _, t in kernels.values())
        print(f"\n{name} {mode} batch {batch}, {impl}: {wall_ms:.2f} ms wall, {total_us / 1e3:.2f} ms of kernels, "
              f"{sum(n for n, _ in kernels.values()):.0f} launches per step")
        print_top(kernels)


if __name__ == "__main__":
    main()
