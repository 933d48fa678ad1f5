"""Plain GELU (erf) on the GPU: torch's kernel, torch.compile's, and ours by rows and as one flat row over a
few block sizes, forward and backward, in GB/s and as a fraction of the device copy bandwidth. Picks
``activations._FLAT_BLOCK`` / ``_FLAT_WARPS`` and tells whether "auto" should stay on torch's GELU.

    PYTHONPATH=.:kernels python scripts/profile/activation_sweep.py   # on a CUDA GPU
"""

import importlib

import torch
import torch.nn.functional as F

from flash_kernels._triton_utils import as_rows
from flash_models.bench.harness import measure_copy_bandwidth, time_cuda

act = importlib.import_module("flash_kernels.activations")
SHAPES = [(16384, 3072), (8192, 11008)]  # BERT-base / GPT-2 MLP at 16k tokens; LLaMA-7B's at 8k
FLAT_CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]


def by_rows(gated, *tensors):
    return [as_rows(t) for t in tensors]


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s")
    print("| shape | impl | fwd_us | fwd_frac_copy | bwd_us | bwd_frac_copy |")
    print("|---|---|---|---|---|---|")
    for rows, width in SHAPES:
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()  # fwd moves 2x this, bwd 3x
        compiled = torch.compile(lambda t: F.gelu(t))
        sides = {
            "torch F.gelu": (lambda: F.gelu(x), lambda: torch.ops.aten.gelu_backward(dy, x)),
            "torch.compile": (lambda: compiled(x), None),
            "ours by rows": (lambda: act._act_fwd(x, "gelu", False), lambda: act._act_bwd(x, dy, "gelu", False)),
        }
        for block, warps in FLAT_CONFIGS:
            sides[f"ours flat {block}/{warps}w"] = (lambda: act._act_fwd(x, "gelu", False),
                                                    lambda: act._act_bwd(x, dy, "gelu", False), block, warps)
        for name, (fwd, bwd, *config) in sides.items():
            launch_rows, flat = act._as_launch_rows, (act._FLAT_BLOCK, act._FLAT_WARPS)
            if name == "ours by rows":
                act._as_launch_rows = by_rows
            if config:
                act._FLAT_BLOCK, act._FLAT_WARPS = config
            try:
                f_us = time_cuda(fwd, repeats=50).median_ms * 1e3
                b_us = time_cuda(bwd, repeats=50).median_ms * 1e3 if bwd else float("nan")
            finally:
                act._as_launch_rows, (act._FLAT_BLOCK, act._FLAT_WARPS) = launch_rows, flat
            print(f"| {rows}x{width} | {name} | {f_us:.1f} | {2 * nbytes / (f_us * 1e-6) / copy_bw:.3f} "
                  f"| {b_us:.1f} | {3 * nbytes / (b_us * 1e-6) / copy_bw:.3f} |", flush=True)


if __name__ == "__main__":
    main()
