"""`flash-models bench overhead`: host time per call of our ops against torch's, on inputs so small that the
GPU finishes each kernel long before the host has launched the next one.

At BERT-base or GPT-2 sizes on a Hopper GPU a layer's kernels take tens of microseconds, so what the host
spends per call (Python wrapper, argument checks, autograd bookkeeping, the Triton launcher) decides the speed.
This area measures exactly that: back-to-back calls, wall clock, one synchronize at the end, in microseconds
per call, for forward alone, forward under inference_mode, and forward + backward.

``--dry-run`` runs it on the CPU (the reference paths, so the numbers say nothing about the Triton launcher):
it checks the code path.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flash_kernels as fk

from ..backward import backward_on_this_thread
from .harness import BenchResult

HIDDEN, HEADS, HEAD_DIM, TOKENS = 768, 12, 64, 64
COLUMNS = ["op", "mode", "torch_us", "ours_us", "ours_over_torch"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, device: torch.device, *, calls: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def pairs(device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """op -> (torch call, our call), each taking ``x`` (TOKENS, HIDDEN) and ``q`` (1, TOKENS, HEADS, HEAD_DIM)."""
    w = torch.ones(HIDDEN, device=device, dtype=dtype)
    cu = torch.tensor([0, TOKENS // 2, TOKENS], device=device, dtype=torch.int32)

    def sdpa(q):
        t = q.transpose(1, 2)
        return F.scaled_dot_product_attention(t, t, t)

    return {
        "layer_norm": (lambda x, q: F.layer_norm(x, (HIDDEN,), w, w), lambda x, q: fk.layer_norm(x, w, w)),
        "layer_norm + residual": (lambda x, q: F.layer_norm(x + x, (HIDDEN,), w, w),
                                  lambda x, q: fk.layer_norm(x, w, w, residual=x)),
        # "auto" runs torch's own GELU on CUDA; the Triton kernel is what is measured here.
        "gelu": (lambda x, q: F.gelu(x), lambda x, q: fk.gelu(x, backend="triton" if device.type == "cuda" else "auto")),
        "attention": (lambda x, q: sdpa(q), lambda x, q: fk.flash_attn_func(q, q, q)),
        "varlen attention": (lambda x, q: sdpa(q), lambda x, q: fk.flash_attn_varlen_func(
            q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=TOKENS // 2, max_seqlen_k=TOKENS // 2)),
    }


def bench(result: BenchResult, device: torch.device, dtype: torch.dtype, calls: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device, dtype)
    q = torch.randn(1, TOKENS, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    linear_w = torch.randn(HIDDEN, HIDDEN, generator=gen).to(device, dtype)
    result.add(op="linear + bias (for scale)", mode="forward", torch_us=per_call_us(lambda: F.linear(x, linear_w, x[0]), device, calls=calls),
               ours_us=None, ours_over_torch=None)
    xg, qg = x.clone().requires_grad_(), q.clone().requires_grad_()
    for op, (theirs, ours) in pairs(device, dtype).items():
        for mode in ("forward", "inference", "forward+backward"):
            def run(fn, mode=mode):
                if mode == "inference":
                    with torch.inference_mode():
                        return fn(x, q)
                if mode == "forward":
                    return fn(x, q)
                with backward_on_this_thread():  # as the Trainer runs it
                    fn(xg, qg).float().sum().backward()

            t_torch = per_call_us(lambda: run(theirs), device, calls=calls)
            t_ours = per_call_us(lambda: run(ours), device, calls=calls)
            result.add(op=op, mode=mode, torch_us=t_torch, ours_us=t_ours, ours_over_torch=t_ours / t_torch)


def main(argv: list[str] | None = None) -> BenchResult:
    parser = argparse.ArgumentParser(prog="flash-models bench overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="back-to-back calls per measurement")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: checks the code, not the launcher")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype, calls = torch.device("cpu"), torch.float32, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench overhead measures GPU launches and needs a CUDA GPU (or --dry-run)")
        device, dtype, calls = torch.device("cuda"), torch.bfloat16, args.calls
    result = BenchResult(area="overhead")
    result.env.update(dtype=str(dtype).removeprefix("torch."), dry_run=args.dry_run, tokens=TOKENS, hidden=HIDDEN)
    bench(result, device, dtype, calls)
    result.write_json(args.out / "overhead.json")
    print(result.markdown(COLUMNS))
    return result


if __name__ == "__main__":
    main()
