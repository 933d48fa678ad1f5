"""Our dense attention forward at the training grid's short sequences (B*S = 16k, H*D = 2048), for each tile
config, against SDPA's FLASH backend, by CUDA-graph replay (GPU time only). The autotuner's pick is named;
each config is then forced as in ``encoder_attention_sweep``.

    PYTHONPATH=.:kernels python scripts/profile/attention_fwd_sweep.py   # on a CUDA GPU
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_kernels
from encoder_attention_sweep import attention, time_each_config  # this folder's sibling module
from gemm_rows import graphed_us

CASES = [(128, 1024, False), (128, 1024, True), (128, 2048, False), (128, 2048, True), (128, 4096, True),
         (64, 1024, True)]  # (hdim, S, causal)
EXTRA = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 4), (128, 32, 4, 3), (64, 128, 4, 2),
         (128, 128, 4, 2), (128, 64, 4, 4), (64, 64, 4, 2), (128, 128, 8, 4)]


def main():
    print(torch.cuda.get_device_name())
    kernel = attention._attn_fwd_kernel
    candidates = [c.all_kwargs() for c in kernel.autotuner.configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 64 * 32]
    candidates += [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in EXTRA]
    short = lambda m: f"{m['BLOCK_M']}x{m['BLOCK_N']} w{m['num_warps']} s{m['num_stages']}"  # noqa: E731
    for d, s, causal in CASES:
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def ours():
            return flash_kernels.flash_attn_func(q, k, v, causal=causal, backend="triton")

        with torch.no_grad():
            kernel.chosen.clear()
            attention._FWD_PLANS.clear()
            ours()
            pick = dict(next(iter(kernel.chosen.values()))[0])
            times = time_each_config(ours, candidates, f"hdim {d} S {s} causal {causal}")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                fa2 = graphed_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
        times.sort(key=lambda t: t[0])
        picked = next((us for us, m in times if m == pick), float("nan"))
        print(f"hdim {d} S {s} causal {causal}: FA2 {fa2:.1f} us; autotune pick {short(pick)} {picked:.1f} "
              f"({fa2 / picked:.2f}x FA2); best " + ", ".join(f"{short(m)} {us:.1f} ({fa2 / us:.2f}x)" for us, m in times[:5])
              + f"; slowest {times[-1][0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
