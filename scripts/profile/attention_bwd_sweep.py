"""The attention backward's two kernels (dK/dV and dQ) at the training grid's shapes, one tile config at a time,
against SDPA's FLASH backend (FA2): forward + backward replayed from a CUDA graph, replays queued back to back
(GPU time only). The forward keeps its autotuned pick; each backward kernel's candidates (its autotune list
plus EXTRA_*) are forced in turn through the cached-autotune table while the other kernel keeps its pick, and
the backward's launch plans are dropped each time (a plan keeps launching the config it was made with).

Why: f+b at head dim 64, S 4k, non-causal is the thinnest point of issue 3's Must grid, 1.19-1.21x FA2 on an
H100 and an H200 (docs/benchmarks.md, Attention, session 17), and the backward's configs were last swept
before the forward's changes of sessions 15-16.

    PYTHONPATH=.:kernels python scripts/profile/attention_bwd_sweep.py             # on a CUDA GPU, every case
    PYTHONPATH=.:kernels python scripts/profile/attention_bwd_sweep.py 64:4096:0   # one case, hdim:S:causal
"""

import sys

import torch

import flash_kernels  # noqa: F401  (registers the modules read below)
from flash_models.bench.attention import _ours_fn, _prepare, _sdpa_fn
from flash_models.bench.harness import time_cuda

attention = sys.modules["flash_kernels.attention"]
attention_bwd = sys.modules["flash_kernels.attention_bwd"]

CASES = [(64, 4096, False), (64, 2048, False), (64, 1024, False), (128, 4096, True), (128, 1024, True)]  # (hdim, S, causal)
# (BLOCK_M, BLOCK_N, warps, stages) beyond the autotune lists: deeper pipelines for head dim 64, wider tiles.
EXTRA_DKDV = [(32, 128, 4, 4), (32, 128, 4, 5), (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4)]
EXTRA_DQ = [(128, 32, 4, 4), (128, 32, 4, 5), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4)]


def candidates(kernel, extra) -> list[dict]:
    listed = [c.all_kwargs() for c in kernel.autotuner.configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 64 * 32]
    return listed + [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in extra]


def short(meta: dict) -> str:
    return f"{meta['BLOCK_M']}x{meta['BLOCK_N']} w{meta['num_warps']} s{meta['num_stages']}"


def fwd_bwd_us(make_fn, q, k, v) -> float:
    """us of one forward + backward, from a fresh graph (so the configs in force now are the ones captured)."""
    _, both, _ = _prepare(make_fn, q, k, v, graphs=True)
    return time_cuda(both, repeats=20, back_to_back=True).median_ms * 1e3


def sweep(kernel, extra, make_fn, q, k, v, label) -> list[tuple[float, dict]]:
    picks = dict(kernel.chosen)
    times = []
    for meta in candidates(kernel, extra):
        for key in picks:
            kernel.chosen[key] = (meta, None)
        attention._BWD_PLANS.clear()
        try:
            times.append((fwd_bwd_us(make_fn, q, k, v), meta))
        except Exception as err:  # a config that does not fit (shared memory, registers) is reported, not fatal
            print(f"  {label} {short(meta)}: {type(err).__name__}", flush=True)
    kernel.chosen.clear()
    kernel.chosen.update(picks)
    attention._BWD_PLANS.clear()
    return sorted(times, key=lambda t: t[0])


def main(cases):
    print(torch.cuda.get_device_name())
    dkdv, dq = attention_bwd._attn_bwd_dkdv_kernel, attention_bwd._attn_bwd_dq_kernel
    for d, s, causal in cases:
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        for kernel in (dkdv, dq):
            kernel.chosen.clear()
        attention._BWD_PLANS.clear()

        def ours(*t):
            return _ours_fn(*t, causal)

        base = fwd_bwd_us(ours, q, k, v)  # autotunes both kernels
        fa2 = fwd_bwd_us(lambda *t: _sdpa_fn("flash", *t, causal), q, k, v)
        picks = {name: short(next(iter(kernel.chosen.values()))[0]) for name, kernel in (("dkdv", dkdv), ("dq", dq))}
        print(f"hdim {d} S {s} causal {causal}: FA2 f+b {fa2:.1f} us; ours with the picks (dK/dV {picks['dkdv']}, "
              f"dQ {picks['dq']}) {base:.1f} us ({fa2 / base:.3f}x FA2)", flush=True)
        for name, kernel, extra in (("dK/dV", dkdv, EXTRA_DKDV), ("dQ", dq, EXTRA_DQ)):
            times = sweep(kernel, extra, ours, q, k, v, f"hdim {d} S {s} {name}")
            print(f"  {name}: " + ", ".join(f"{short(m)} {us:.1f} ({fa2 / us:.3f}x)" for us, m in times[:6])
                  + (f"; slowest {short(times[-1][1])} {times[-1][0]:.1f}" if times else ""), flush=True)


def parse_case(text: str) -> tuple[int, int, bool]:
    d, s, causal = text.split(":")
    return int(d), int(s), causal == "1"


if __name__ == "__main__":
    main([parse_case(a) for a in sys.argv[1:]] or CASES)
