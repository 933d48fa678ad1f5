"""Host cost per call (us) of one Triton launch and its parts, on a CUDA GPU: torch allocations, a launch
through ``kernel[grid]`` with few and with 33 arguments (like our norm kernel's), the same through
``flash_kernels._launch.LeanKernel`` and through the compiled kernel's own launcher; then our layer_norm against
torch's, and a cProfile of our layer_norm forward (no grad).

    PYTHONPATH=.:kernels python scripts/profile/launch_cost.py                               # ops launched lean
    FLASH_KERNELS_LEAN_LAUNCH=0 PYTHONPATH=.:kernels python scripts/profile/launch_cost.py   # Triton's path
"""

import flash_kernels as fk
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from flash_kernels._launch import LeanKernel
from host_cost import cprofile_stats, host_us  # this folder's sibling script


@triton.jit
def _few_args(X, Y, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    row = tl.program_id(0)
    tl.store(Y + row * N + cols, tl.load(X + row * N + cols, mask=cols < N), mask=cols < N)


@triton.jit
def _many_args(X, R, RS, SEED, W, B, W1, B1, Y, Y1, RO, MASK, MEAN, RSTD, sx, sr, sy, sy1, sro, N, eps, p,
               A: tl.constexpr, Bc: tl.constexpr, C: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
               F: tl.constexpr, G: tl.constexpr, H: tl.constexpr, I: tl.constexpr, J: tl.constexpr,
               BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    row = tl.program_id(0)
    tl.store(Y + row * sy + cols, tl.load(X + row * sx + cols, mask=cols < N), mask=cols < N)


def main():
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    dev = "cuda"
    x = torch.randn(8, 256, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    f = torch.empty(8, device=dev)
    args = (x, x, f, f, f, f, f, f, y, y, y, f, f, f, 256, 256, 256, 0, 0, 256, 1e-5, 0.0)
    kw = dict(A=False, Bc=True, C=False, D=False, E=True, F=False, G=False, H=False, I=False, J=False, BLOCK=256)
    compiled = _many_args[(8,)](*args, **kw)
    lean = LeanKernel(_many_args)
    w, b = torch.ones(256, device=dev), torch.zeros(256, device=dev)
    wb, bb = w.bfloat16(), b.bfloat16()
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    dy = torch.randn_like(x)
    rows = {
        "torch.empty (8, 256) bf16": lambda: torch.empty((8, 256), device=dev, dtype=torch.bfloat16),
        "torch.empty(0)": lambda: torch.empty(0, device=dev),
        "torch.add": lambda: torch.add(x, x),
        "3-argument kernel[grid]": lambda: _few_args[(8,)](x, y, 256, BLOCK=256),
        "33-argument kernel[grid]": lambda: _many_args[(8,)](*args, **kw),
        "33-argument LeanKernel[grid]": lambda: lean[(8,)](*args, **kw),
        "33-argument compiled launcher": lambda: compiled[(8, 1, 1)](*args, *kw.values()),
    }
    with torch.no_grad():
        rows["our layer_norm forward, no grad"] = lambda: fk.layer_norm(x, w, b)
        rows["torch layer_norm forward, no grad"] = lambda: F.layer_norm(x, (256,), wb, bb)
    for name, fn in rows.items():
        grad = torch.no_grad() if "no grad" in name else torch.enable_grad()
        with grad:
            print(f"| {name} | {host_us(fn, 2000):.1f} |")
    with torch.autograd.set_multithreading_enabled(False):
        fb = lambda: torch.autograd.grad(fk.layer_norm(xg, wg, bg), (xg, wg, bg), dy)  # noqa: E731
        print(f"| our layer_norm forward + backward (calling thread) | {host_us(fb, 500):.1f} |")
    with torch.no_grad():
        stats = cprofile_stats(lambda: fk.layer_norm(x, w, b), 2000)
    torch.cuda.synchronize()
    print(stats)


if __name__ == "__main__":
    main()
