"""The Hopper (Gluon) attention backward against the Triton backward and cuDNN's, graph-replayed, bf16,
B * S = 16k, H * D = 2048 (``bench attention``'s training grid).

Per shape: forward + backward us through ``flash_attn_func`` with the Gluon backward ("gluon") and with it off
("triton"), SDPA's cuDNN backend's forward + backward, and the forward alone of each (ours / cuDNN), so that the
backward alone is f+b minus f. Rows the library does not send to the Gluon backward (head dim 64, under
``MIN_KEYS``) are timed with it forced on (``attention_hopper_bwd.MIN_KEYS``), to show why.

    PYTHONPATH=.:kernels python scripts/profile/hopper_backward.py [--causal] [--hdim64]   # on a Hopper GPU
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_kernels import attention_hopper_bwd, flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_rows import graphed_us  # noqa: E402


def best_us(fn, rounds: int = 2) -> float:
    return min(graphed_us(fn) for _ in range(rounds))


def time_shape(s: int, d: int, causal: bool) -> dict:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dout_t = dout.transpose(1, 2)

    def ours_fwd():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=causal)

    def ours_fb():
        torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)

    def cudnn_fwd():
        with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def cudnn_fb():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        torch.autograd.grad(out, (qt, kt, vt), dout_t)

    row = {"ours_f": best_us(ours_fwd), "cudnn_f": best_us(cudnn_fwd), "cudnn_fb": best_us(cudnn_fb)}
    taken = dict(attention_hopper_bwd.MIN_KEYS)
    attention_hopper_bwd.MIN_KEYS[(d, causal)] = 0
    try:
        row["gluon_fb"] = best_us(ours_fb)
        previous = attention_hopper_bwd.use_hopper_backward(False)
        row["triton_fb"] = best_us(ours_fb)
        attention_hopper_bwd.use_hopper_backward(previous)
    finally:
        attention_hopper_bwd.MIN_KEYS.clear()
        attention_hopper_bwd.MIN_KEYS.update(taken)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--causal", action="store_true", help="also the causal rows")
    parser.add_argument("--hdim64", action="store_true", help="also head dim 64")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    print("| d | S | causal | gluon bwd | triton bwd | cuDNN bwd | gluon f+b | triton f+b | cuDNN f+b "
          "| cuDNN / gluon f+b | cuDNN / triton f+b |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for d in [128, 64] if args.hdim64 else [128]:
        for causal in [False, True] if args.causal else [False]:
            for s in args.seqlens:
                r = time_shape(s, d, causal)
                backward = (r["gluon_fb"] - r["ours_f"], r["triton_fb"] - r["ours_f"], r["cudnn_fb"] - r["cudnn_f"])
                both = (r["gluon_fb"], r["triton_fb"], r["cudnn_fb"])
                ratios = (r["cudnn_fb"] / r["gluon_fb"], r["cudnn_fb"] / r["triton_fb"])
                cells = [f"{x:.0f}" for x in (*backward, *both)] + [f"{x:.3f}" for x in ratios]
                print(f"| {d} | {s} | {causal} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
