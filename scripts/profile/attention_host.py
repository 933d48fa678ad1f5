"""Host cost of one eager attention forward (ours against SDPA), where it goes, and what it does to the
eager-timed forward at the training grid's short sequences.

1. Host us per call at a tiny shape (the GPU idles, so the Python loop's time is the host's): ours with grad
   mode on but no input needing grad (how `bench attention` times a forward), ours under no_grad, and SDPA
   pinned to each backend.
2. A cProfile of 300 of our forwards, by own time.
3. Per-call time of the forward at B*S = 16k, H*D = 2048, S = 1k and 2k, eager (CUDA events around each call,
   as `bench attention` times it) and graph-replayed (the GPU work alone), ours and SDPA's FLASH and cuDNN.
4. Graph-replayed forward with a positive against a negative softmax scale: the same tile config and the same
   work, but a negative scale takes the forward's older score path (scale every product, then the row max),
   a positive one the raw-max path (row max of the raw products, scaling folded into the exponent's FMA).

    PYTHONPATH=.:kernels python scripts/profile/attention_host.py   # on a CUDA GPU
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_kernels as fk  # noqa: E402
from host_cost import cprofile_stats, host_us  # noqa: E402

from flash_models.bench.harness import time_cuda  # noqa: E402

SDPA = {"FA2": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}


def sdpa_call(q, k, v, causal, backend):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return run


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_table():
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    ours = lambda: fk.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    print("| call (1 x 128 x 2 x 64, causal) | host us |\n|---|---|")
    print(f"| ours forward, grad mode on | {host_us(ours):.1f} |")
    with torch.no_grad():
        print(f"| ours forward, no_grad | {host_us(ours):.1f} |")
    for name, backend in SDPA.items():
        print(f"| SDPA {name} forward, grad mode on | {host_us(sdpa_call(q, k, v, True, backend)):.1f} |")
    print(f"\n==== cProfile ours forward, grad mode on (300 calls)\n{cprofile_stats(ours, 300, rows=30)}")
    torch.cuda.synchronize()


def training_shapes():
    """(hdim, S, causal, q, k, v) over the training grid's short sequences: B*S = 16k, H*D = 2048, bf16."""
    for d in (64, 128):
        for s in (1024, 2048):
            b, h = 16384 // s, 2048 // d
            q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            for causal in (False, True):
                yield d, s, causal, q, k, v


def forward_table():
    print("| hdim | S | causal | side | eager us | graph us | eager - graph |\n|---|---|---|---|---|---|---|")
    for d, s, causal, q, k, v in training_shapes():
        sides = {"ours": lambda: fk.flash_attn_func(q, k, v, causal=causal, backend="triton")}
        sides.update({name: sdpa_call(q, k, v, causal, be) for name, be in SDPA.items()})
        for name, fn in sides.items():
            eager = time_cuda(fn, repeats=30).median_ms * 1e3
            replay = time_cuda(graphed(fn), repeats=30).median_ms * 1e3
            print(f"| {d} | {s} | {causal} | {name} | {eager:.1f} | {replay:.1f} | {eager - replay:.1f} |", flush=True)


def raw_max_table():
    print("| hdim | S | causal | raw-max path us | scaled-scores path us | ratio |\n|---|---|---|---|---|---|")
    for d, s, causal, q, k, v in training_shapes():
        us = [time_cuda(graphed(lambda sign=sign: fk.flash_attn_func(
            q, k, v, causal=causal, softmax_scale=sign * d ** -0.5, backend="triton")), repeats=30).median_ms * 1e3
              for sign in (1.0, -1.0)]
        print(f"| {d} | {s} | {causal} | {us[0]:.1f} | {us[1]:.1f} | {us[1] / us[0]:.3f} |", flush=True)


def main():
    host_table()
    forward_table()
    raw_max_table()


if __name__ == "__main__":
    main()
