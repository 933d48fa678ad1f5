"""Steps of a `bench train --hf-trainer` side inside transformers.Trainer, profiled: where the step's time goes
beyond the plain loop's. Kernel time by kernel, the host's time by op, and the GPU's idle gaps named by the
kernels around them. The Trainer drains the GPU's queue twice a step: it reads the loss on the host (its NaN
filter), and accelerate copies each batch to the GPU with a blocking copy; the launches after each wait for the
host.

    PYTHONPATH=.:kernels python scripts/profile/trainer_steps.py [case] [side]   # llama-1b ours; CUDA
"""

import sys

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from flash_models.bench.train import CASES, no_dropout
from flash_models.bench.train_hf import measure
from flash_models.train.metrics import measure_matmul_peak
from kernel_table import kernels_per_step, print_gaps, print_host_ops, print_top

WARMUP, PROFILED = 4, 3


class _Profile(transformers.TrainerCallback):
    """torch.profiler around the optimizer steps after ``WARMUP``: from one step's end to ``PROFILED`` ends later."""

    def __init__(self):
        self.ends, self.prof = 0, None

    def on_step_end(self, args, state, control, **kwargs):
        self.ends += 1
        if self.ends == WARMUP:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif self.ends == WARMUP + PROFILED:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    side = sys.argv[2] if len(sys.argv) > 2 else "ours"
    case, device = CASES[name], torch.device("cuda")
    probe = _Profile()
    row = measure(side, case, no_dropout(case.preset), device, steps=PROFILED + 2, warmup=WARMUP,
                  peak_flops=measure_matmul_peak(device), callbacks=(probe,))
    print(f"{name} {side} in transformers.Trainer: {row['step_ms']:.2f} ms per step (the profiled steps among them)")
    kernels = kernels_per_step(probe.prof, PROFILED)
    print(f"kernels {sum(t for _, t in kernels.values()) / 1e3:.2f} ms per step:")
    print_top(kernels, 30)
    print_host_ops(probe.prof, PROFILED)
    print_gaps(probe.prof, PROFILED)


if __name__ == "__main__":
    main()
