"""GPU kernel time against wall time for the ops of ``flash-models bench ops``: ours and each peer (torch eager,
torch.compile, liger where installed), forward (no grad) and forward + backward, at the bench's shapes. Where
the wall time is well above the kernel time, the call is host-bound and the ratio in the bench's table is a
ratio of host costs; where they are close, it compares kernels.

    PYTHONPATH=.:kernels python scripts/profile/op_kernels.py norms rotary   # on a CUDA GPU (groups: bench ops --only)
"""

import sys

import torch
from kernel_table import time_and_profile  # this folder's sibling script

from flash_models.bench.ops import GROUPS, fwd_bwd_step


def main(groups: list[str]):
    print("| op | shape | impl | fwd wall us | fwd kernels us | f+b wall us | f+b kernels us | f+b launches |")
    print("|---|---|---|---|---|---|---|---|")
    for group in groups or ["norms"]:
        for case in GROUPS[group](True):
            for name, fn in case.impls.items():
                try:
                    with torch.no_grad():
                        fwd_ms, fwd_kernels = time_and_profile(fn, steps=20)
                    fb_ms, fb_kernels = time_and_profile(fwd_bwd_step(fn, case.side_inputs.get(name, case.inputs)), steps=20)
                except Exception as err:  # a peer that rejects this input: report it, go on
                    print(f"| {case.op} | {case.shape} | {name} | {type(err).__name__}: {str(err)[:80]} |||||")
                    continue
                kernel_us = lambda kernels: sum(us for _, us in kernels.values())  # noqa: E731
                launches = sum(n for n, _ in fb_kernels.values())
                print(f"| {case.op} | {case.shape} | {name} | {fwd_ms * 1e3:.0f} | {kernel_us(fwd_kernels):.0f} "
                      f"| {fb_ms * 1e3:.0f} | {kernel_us(fb_kernels):.0f} | {launches:.0f} |", flush=True)
            del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
