"""Host time of one fused-norm forward + backward step (``bench ops``' own step) at a tiny shape, where the GPU
idles, ours against torch.compile of the unfused RMS norm: three rounds (the lent machine's host swings by up
to 2x between them), then a cProfile of ours.

    PYTHONPATH=.:kernels python scripts/profile/norm_fb_host.py   # on a CUDA GPU
"""

import torch

from flash_kernels import rms_norm
from flash_models.bench.ops import _fwd_bwd_step
from host_cost import cprofile_stats, host_us  # this folder's sibling script


def rms_norm_unfused(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def main():
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(rms_norm_unfused)
    steps = {
        "ours rms_norm": _fwd_bwd_step(lambda: rms_norm(x, w, eps=1e-6), [x, w]),
        "torch.compile rms_norm": _fwd_bwd_step(lambda: compiled(x, w), [x, w]),
        "ours add+rms_norm prenorm": _fwd_bwd_step(lambda: rms_norm(x, w, residual=r, prenorm=True, eps=1e-6),
                                                   [x, r, w]),
    }
    for round_ in range(3):
        print(f"round {round_}: " + ", ".join(f"{name} {host_us(step, n=2000):.1f} us" for name, step in steps.items()),
              flush=True)
    print(cprofile_stats(steps["ours rms_norm"], 2000, rows=30))


if __name__ == "__main__":
    main()
