"""The Python cost of our op wrappers alone, on any machine: each op's Triton launch is replaced by a no-op and
its forward is called (no grad) on CPU tensors, so what is timed is the argument checks, the allocations and
the launch arithmetic around the kernel. CPU allocations of large tensors cost more than the CUDA caching
allocator's, so read the profile's rows rather than the total as a GPU host's cost.

    PYTHONPATH=.:kernels python scripts/profile/wrapper_cost.py   # no GPU needed
"""

import importlib
import time

import torch
from host_cost import cprofile_stats  # this folder's sibling script


class NoLaunch:
    """Stands in for a launched kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub(module_name: str, *kernels: str):
    module = importlib.import_module(module_name)
    for name in kernels:
        setattr(module, name, NoLaunch())
    module.use_triton = lambda *args, **kwargs: True
    return module


def report(name: str, call, calls: int = 3000) -> None:
    for _ in range(200):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    print(f"{name}: {(time.perf_counter() - start) / calls * 1e6:.1f} us per call, launch excluded")
    print(cprofile_stats(call, calls, rows=12))


def main():
    attention = stub("flash_kernels.attention", "_attn_fwd_kernel")
    attention._dot_f32 = lambda q: False  # bf16 on the CPU would otherwise ask for the interpreter's fp32 dots
    norm = stub("flash_kernels.layer_norm", "_norm_fwd_kernel")
    q = torch.randn(4, 1024, 16, 128, dtype=torch.bfloat16)
    x, w, b = torch.randn(8, 4096, dtype=torch.bfloat16), torch.ones(4096), torch.zeros(4096)
    with torch.no_grad():
        report("flash_attn_func forward (4 x 1024 x 16 x 128, causal)",
               lambda: attention.flash_attn_func(q, q, q, causal=True))
        report("layer_norm forward (8 x 4096)", lambda: norm.layer_norm(x, w, b))


if __name__ == "__main__":
    main()
