"""Kernel time of one ViT step, ours vs timm eager, per kernel name: where `bench vit` loses or wins.

    PYTHONPATH=.:kernels python scripts/profile/vit_kernels.py [vit-b16] [training|inference] [batch]   # on a CUDA GPU

Prints, per side, the wall time of a step, the GPU kernel time inside it (their gap is host overhead) and the
25 most expensive kernels per step.
"""

import sys

import torch

from flash_models.bench.vit import step_fns, build_models
from kernel_table import print_step, time_and_profile  # this folder's sibling module


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
        inference, training = step_fns(model, images, labels, impl=impl)
        print_step(f"{name} {mode} batch {batch}, {impl}", *time_and_profile(training if mode == "training" else inference))


if __name__ == "__main__":
    main()
