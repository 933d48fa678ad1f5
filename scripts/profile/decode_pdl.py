"""Decode attention with and without programmatic dependent launch (``flash_kernels.programmatic_launch``), in
one process, alternating, each side graph-replayed over independent caches as `bench attention` times decode:
GB/s of K+V read and the fraction of the device copy bandwidth. Issue 3's Must is >= 0.80 of copy bandwidth at
batch 1 with KV >= 8k (0.76-0.78 on an H100 with plain launches, docs/benchmarks.md, session 9).

    PYTHONPATH=.:kernels python scripts/profile/decode_pdl.py   # on a Hopper GPU
"""

import torch

from flash_kernels import flash_attn_with_kvcache, programmatic_launch
from flash_models.bench.attention import _decode_inputs, _time_decode
from flash_models.bench.harness import measure_copy_bandwidth

HEADS, KV_HEADS, HEAD_DIM = 16, 16, 128  # as `bench attention` decodes
CASES = [(1, 8192), (1, 16384), (1, 32768), (8, 8192), (64, 2048)]  # (batch, KV length)
ROUNDS = 2


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s")
    print("| batch | kv | round | plain GB/s | plain frac | pdl GB/s | pdl frac | pdl / plain |")
    print("|---|---|---|---|---|---|---|---|")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for batch, kv in CASES:
        nbytes = 2 * batch * kv * KV_HEADS * HEAD_DIM * 2
        sets = _decode_inputs(batch, kv, HEADS, KV_HEADS, HEAD_DIM, max(1, min(8, -(-4 * l2 // nbytes))))
        seqlens = torch.full((batch,), kv, dtype=torch.int32, device="cuda")

        def call(q, kc, vc):
            return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, backend="triton")

        for rnd in range(ROUNDS):
            gbs = {}
            for pdl in (False, True):
                with programmatic_launch(pdl, early_trigger=batch == 1):  # the graphs are captured inside
                    _, graphed_ms = _time_decode(call, sets, repeats=50)
                gbs[pdl] = nbytes / (graphed_ms * 1e-3) / 1e9
            print(f"| {batch} | {kv} | {rnd} | {gbs[False]:.0f} | {gbs[False] * 1e9 / copy_bw:.3f} | {gbs[True]:.0f} "
                  f"| {gbs[True] * 1e9 / copy_bw:.3f} | {gbs[True] / gbs[False]:.3f} |", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
