"""Our varlen attention forward at BERT's shapes, for each tile config, against torch SDPA on the padded batch,
by CUDA-graph replay (GPU time only). The autotuner's pick is named; each config is then forced through the
cached-autotune table (``CachedAutotune.chosen``), with the forward's launch plans dropped (a plan would keep
launching the config it was made with).

    PYTHONPATH=.:kernels python scripts/profile/encoder_attention_sweep.py   # on a CUDA GPU
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_kernels
from flash_models.bench.bert import make_batch
from gemm_rows import graphed_us  # this folder's sibling module

attention = sys.modules["flash_kernels.attention"]
# (name, rows, seq, padding, heads): bench bert's batches of 16k padded tokens
CASES = [("bert-base 128 0%", 128, 128, 0.0, 12), ("bert-base 512 0%", 32, 512, 0.0, 12),
         ("bert-large 128 0%", 128, 128, 0.0, 16), ("bert-large 512 0%", 32, 512, 0.0, 16),
         ("bert-large 512 45%", 32, 512, 0.5, 16), ("bert-large 128 51%", 128, 128, 0.5, 16)]
EXTRA = [(64, 128, 4, 2), (128, 128, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2), (128, 64, 4, 2), (64, 64, 2, 2),
         (32, 128, 4, 2), (64, 64, 4, 1), (128, 128, 8, 1), (64, 128, 4, 1), (64, 64, 4, 2), (64, 64, 8, 2),
         (64, 64, 2, 3), (32, 64, 4, 2), (32, 64, 2, 2), (64, 128, 4, 3), (32, 32, 2, 2), (128, 32, 4, 2)]


def force_fwd_config(meta: dict) -> None:
    """Make every key the forward's autotuner has chosen for launch ``meta`` from now on."""
    kernel = attention._attn_fwd_kernel
    for key in list(kernel.chosen):
        kernel.chosen[key] = (meta, None)
    attention._FWD_PLANS.clear()


def time_each_config(fn, candidates: list[dict], label: str) -> list[tuple[float, dict]]:
    """(graph-replayed us of fn, config) for each candidate forced in turn; a config that does not fit (shared
    memory) is reported, not fatal."""
    times = []
    for meta in candidates:
        force_fwd_config(meta)
        try:
            times.append((graphed_us(fn), meta))
        except Exception as e:
            print(f"  {label} {meta}: {type(e).__name__}")
    return times


def main():
    print(torch.cuda.get_device_name())
    kernel = attention._attn_fwd_kernel
    candidates = [c.all_kwargs() for c in kernel.autotuner.configs]
    candidates += [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in EXTRA]
    for name, rows, seq, padding, heads in CASES:
        _, mask = make_batch(rows, seq, padding, 1000, "cuda")
        lengths = mask.sum(1)
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        total, longest = int(lengths.sum()), int(lengths.max())
        q, k, v = (torch.randn(total, heads, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def ours():
            return flash_kernels.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                                        max_seqlen_k=longest, backend="triton")

        with torch.no_grad():
            ours()
            pick = dict(next(iter(kernel.chosen.values()))[0]) if kernel.chosen else {}
            times = time_each_config(ours, candidates, name)
            kernel.chosen.clear()
            attention._FWD_PLANS.clear()
            dense = ""
            if padding == 0:  # every row full: the same tokens as a dense (B, S) batch, no cu_seqlens to read
                qd, kd, vd = (t.view(rows, seq, heads, 64) for t in (q, k, v))
                dense_us = graphed_us(lambda: flash_kernels.flash_attn_func(qd, kd, vd, backend="triton"))
                dense = f"; dense (B, S) call, its own pick: {dense_us:.1f}"
            qp, kp, vp = (torch.randn(rows, heads, seq, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            bias = None if padding == 0 else torch.where(mask.bool(), 0.0, float("-inf")).to(torch.bfloat16)[:, None, None, :]
            peers = {}
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                try:
                    with sdpa_kernel(backend):
                        peers[backend.name] = graphed_us(lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias))
                except RuntimeError:
                    peers[backend.name] = float("nan")
        times.sort(key=lambda t: t[0])
        short = lambda m: f"{m['BLOCK_M']}x{m['BLOCK_N']} w{m['num_warps']} s{m['num_stages']}"  # noqa: E731
        print(f"{name}: tokens {total}, autotune pick {short(pick) if pick else '?'}; "
              + ", ".join(f"{short(m)} {us:.1f}" for us, m in times[:6]) + " us; slowest "
              + f"{times[-1][0]:.1f}{dense}; SDPA padded: " + ", ".join(f"{b} {us:.1f}" for b, us in peers.items()))


if __name__ == "__main__":
    main()
