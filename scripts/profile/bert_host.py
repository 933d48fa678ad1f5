"""BERT-base training step (bench bert's, ours, eager, seq 128, 51% padding): host time vs kernel time, then a
cProfile of the host side, sorted by own time and by cumulative time.

    PYTHONPATH=.:kernels python scripts/profile/bert_host.py   # on a CUDA GPU
"""

import time

import torch

from flash_models.bench.bert import _step_fns, build_pair, make_batch
from host_cost import cprofile_stats  # this folder's sibling scripts
from kernel_table import kernels_per_step


def main():
    device = torch.device("cuda")
    hf, ours = build_pair("bert-base", dtype=torch.bfloat16, device=device, dry_run=False)
    ids, mask = make_batch(128, 128, 0.5, hf.config.vocab_size, device)
    ours.train()
    _, training = _step_fns(ours, ids, mask, is_hf=False)
    for _ in range(5):
        training()
    torch.cuda.synchronize()
    steps = 10
    start = time.perf_counter()
    for _ in range(steps):
        training()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    # The host is ahead of the GPU only if it queues a step faster than the GPU runs one.
    print(f"host per step {(queued - start) * 1e3 / steps:.2f} ms, wall {(done - start) * 1e3 / steps:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            training()
        torch.cuda.synchronize()
    kernel_us = sum(us for _, us in kernels_per_step(prof, 5).values())
    print(f"kernel ms/step {kernel_us / 1e3:.2f}")
    stats = cprofile_stats(training, steps, sorts=("tottime", "cumulative"), rows=45)
    torch.cuda.synchronize()
    print(stats)


if __name__ == "__main__":
    main()
