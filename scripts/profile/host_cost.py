"""Host cost per call (us) of our layer_norm and attention against torch's, at tiny shapes where the GPU idles,
with autograd's backward on its CUDA worker thread (the default) and on the calling thread; then a cProfile of
each forward+backward on the calling thread.

    PYTHONPATH=.:kernels python scripts/profile/host_cost.py   # on a CUDA GPU
"""

import cProfile
import io
import pstats
import time

import flash_kernels as fk
import torch
import torch.nn.functional as F


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / n * 1e6


def cprofile_stats(fn, calls: int, *, sorts: tuple[str, ...] = ("tottime",), rows: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn``, printed once per sort key. Syncs nothing: a GPU caller syncs."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    for key in sorts:
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(rows)
    return out.getvalue()


def main():
    dev = "cuda"
    h = torch.randn(8, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, device=dev, requires_grad=True)
    b = torch.zeros(256, device=dev, requires_grad=True)
    wb, bb = w.detach().bfloat16().requires_grad_(), b.detach().bfloat16().requires_grad_()
    q = torch.randn(1, 128, 2, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)

    calls = {
        "ours layer_norm f+b": lambda: fk.layer_norm(h, w, b).sum().backward(),
        "torch layer_norm f+b": lambda: F.layer_norm(h, (256,), wb, bb).sum().backward(),
        "ours attention f+b": lambda: fk.flash_attn_func(q, k, v, causal=True).sum().backward(),
        "sdpa f+b": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).sum().backward(),
    }
    with torch.no_grad():
        print(f"| ours layer_norm forward, no grad | {host_us(lambda: fk.layer_norm(h, w, b)):.1f} |")
        print(f"| torch layer_norm forward, no grad | {host_us(lambda: F.layer_norm(h, (256,), wb, bb)):.1f} |")
        print(f"| ours attention forward, no grad | {host_us(lambda: fk.flash_attn_func(q, k, v, causal=True)):.1f} |")
    for threaded in (True, False):
        with torch.autograd.set_multithreading_enabled(threaded):
            for name, fn in calls.items():
                where = "worker thread" if threaded else "calling thread"
                print(f"| {name}, backward on the {where} | {host_us(fn):.1f} |")
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("ours attention f+b", "ours layer_norm f+b"):
            stats = cprofile_stats(calls[name], 300)
            torch.cuda.synchronize()
            print(f"==== cProfile {name} (300 calls)\n{stats}")


if __name__ == "__main__":
    main()
