"""The Python cost of our op wrappers alone, on any machine: each op's Triton launch is replaced by a no-op and
its forward is called (no grad) on CPU tensors, so what is timed is the argument checks, the allocations and
the launch arithmetic around the kernel. CPU allocations of large tensors cost more than the CUDA caching
allocator's, so read the profile's rows rather than the total as a GPU host's cost.

    PYTHONPATH=.:kernels python scripts/profile/wrapper_cost.py           # no GPU needed
    PYTHONPATH=.:kernels python scripts/profile/wrapper_cost.py fwd-bwd   # norms and rotary, forward + backward

``fwd-bwd`` times what ``bench ops`` times for its norm and rotary rows (forward, then ``torch.autograd.grad`` on
the calling thread), at a tiny shape with every kernel launch stubbed out, against a bare autograd.Function:
the Python and autograd cost of our eager ops, min of 5 rounds of 1000 steps.
"""

import importlib
import sys
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


class _Bare(torch.autograd.Function):
    """The floor: an autograd.Function that allocates its output and input gradients and does nothing else."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


def fwd_bwd_costs() -> None:
    from flash_models.bench.ops import _fwd_bwd_step

    norm = stub("flash_kernels.layer_norm", "_norm_fwd_kernel", "_norm_bwd_kernel")
    stub("flash_kernels.partial_sums", "_sum_partials_kernel")
    rotary = stub("flash_kernels.rotary", "_rotary_kernel")
    x, r = (torch.randn(8, 4096, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(4096, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    x3 = torch.randn(2, 4, 4096, dtype=torch.bfloat16, requires_grad=True)  # a model's (batch, seq, hidden)
    q, k = (torch.randn(1, 8, 4, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    angles = torch.rand(8, 64)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    steps = {
        "bare autograd.Function": _fwd_bwd_step(lambda: _Bare.apply(x, w), [x, w]),
        "rms_norm": _fwd_bwd_step(lambda: norm.rms_norm(x, w), [x, w]),
        "rms_norm, 3-D input": _fwd_bwd_step(lambda: norm.rms_norm(x3, w), [x3, w]),
        "add+rms_norm prenorm": _fwd_bwd_step(lambda: norm.rms_norm(x, w, residual=r, prenorm=True), [x, r, w]),
        "layer_norm": _fwd_bwd_step(lambda: norm.layer_norm(x, w, b), [x, w, b]),
        "rotary q+k": _fwd_bwd_step(lambda: (rotary.apply_rotary(q, cos, sin), rotary.apply_rotary(k, cos, sin)), [q, k]),
    }
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(5):  # rounds interleaved, so a slow spell of a noisy host hits every op alike
        for name, step in steps.items():
            for _ in range(100):
                step()
            start = time.perf_counter()
            for _ in range(1000):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / 1000 * 1e6)
    for name, us in best.items():
        print(f"{name} forward + backward: {us:.1f} us per step, launches excluded")


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
    fwd_bwd_costs() if sys.argv[1:] == ["fwd-bwd"] else main()
