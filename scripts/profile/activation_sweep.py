"""Plain GELU (erf and tanh) on the GPU: torch's kernel, torch.compile's, and ours by rows and as one flat row
over a few block sizes, forward and backward (kernel time, from CUDA-graph replays), as a fraction of the
device copy bandwidth. Picks ``activations._FLAT`` (block and warps per direction) and tells whether "auto"
should take ours or torch's GELU; "ours, portable math" is the shipped launch with ``_ptx_math.ENABLED``
off (the interpreter's exp2), an A/B of the PTX form.

    PYTHONPATH=.:kernels python scripts/profile/activation_sweep.py   # on a CUDA GPU
"""

import importlib

import torch
import torch.nn.functional as F

from flash_kernels import _ptx_math
from flash_kernels._triton_utils import as_rows
from flash_models.bench.harness import measure_copy_bandwidth
from gemm_rows import graphed_us  # this folder's sibling module

act = importlib.import_module("flash_kernels.activations")
# BERT-base / GPT-2 MLP at 16k tokens; BERT-large's; LLaMA-7B's at 8k
SHAPES = [(16384, 3072), (16384, 4096), (8192, 11008)]
FLAT_CONFIGS = [(1024, 4), (2048, 2), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]


def by_rows(gated, *tensors):
    return [as_rows(t) for t in tensors]


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s")
    print("| shape | GELU | impl | fwd_us | fwd_frac_copy | bwd_us | bwd_frac_copy |")
    print("|---|---|---|---|---|---|---|")
    for (rows, width), approximate in [(shape, a) for shape in SHAPES for a in ("none", "tanh")]:
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()  # fwd moves 2x this, bwd 3x
        kind = "gelu" if approximate == "none" else "gelu_tanh"
        compiled = torch.compile(lambda t: F.gelu(t, approximate=approximate))
        sides = {
            "torch F.gelu": (lambda: F.gelu(x, approximate=approximate),
                             lambda: torch.ops.aten.gelu_backward(dy, x, approximate=approximate)),
            "torch.compile": (lambda: compiled(x), None),
            "ours by rows": (lambda: act._act_fwd(x, kind, False), lambda: act._act_bwd(x, dy, kind, False)),
        }
        # The shipped kernel with its reciprocal and exp2 in portable Triton rather than PTX (the erf GELU only).
        sides["ours, portable math"] = sides["ours by rows"]
        for block, warps in FLAT_CONFIGS:
            sides[f"ours flat {block}/{warps}w"] = (lambda: act._act_fwd(x, kind, False),
                                                    lambda: act._act_bwd(x, dy, kind, False), block, warps)
        for name, (fwd, bwd, *config) in sides.items():
            launch_rows, flat, ptx = act._as_launch_rows, dict(act._FLAT), _ptx_math.ENABLED
            if name == "ours by rows":
                act._as_launch_rows = by_rows
            if name == "ours, portable math":
                _ptx_math.ENABLED = False
            if config:
                act._FLAT.update(fwd=tuple(config), bwd=tuple(config))
            try:
                f_us = graphed_us(fwd)
                b_us = graphed_us(bwd) if bwd else float("nan")
            finally:
                act._as_launch_rows, _ptx_math.ENABLED = launch_rows, ptx
                act._FLAT.update(flat)
            print(f"| {rows}x{width} | {approximate} | {name} | {f_us:.1f} | {2 * nbytes / (f_us * 1e-6) / copy_bw:.3f} "
                  f"| {b_us:.1f} | {3 * nbytes / (b_us * 1e-6) / copy_bw:.3f} |", flush=True)


if __name__ == "__main__":
    main()
