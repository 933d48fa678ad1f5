"""How close can one streaming launch get to copy bandwidth on batch-1 decode's 67 MB (KV 8k, 16 heads, hdim 128,
bf16)? Our decode (plain and under programmatic launch) against Triton kernels that only read the same bytes,
in decode's access pattern (program = split x head) and contiguously, and a ``copy_`` of the same size; graph
replays over rotating caches, as ``bench attention`` times decode (docs/benchmarks.md, Attention, session 19).

    PYTHONPATH=.:kernels python scripts/profile/decode_floor.py   # on a CUDA GPU
"""

import torch
import triton
import triton.language as tl
from flash_kernels import flash_attn_with_kvcache, programmatic_launch

from flash_models.bench.attention import _decode_inputs
from flash_models.bench.harness import graph_replay, measure_copy_bandwidth, time_cuda


@triton.jit
def _stream_contig(K, V, Out, n_per_prog, BLOCK: tl.constexpr):
    """Each program sums its contiguous slice of K and of V (n_per_prog elements each)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid.to(tl.int64) * n_per_prog
    for i in range(0, n_per_prog, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(K + offs).to(tl.float32) + tl.load(V + offs).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc))


@triton.jit
def _stream_heads(K, V, Out, keys_per_prog, H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Decode's access pattern without its math: program (split, head) sums K and V rows of one head over its
    key chunk, rows H * D elements apart."""
    split, h = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    start = split * keys_per_prog
    for n in range(start, start + keys_per_prog, BLOCK_N):
        ptr = (n + rows)[:, None].to(tl.int64) * (H * D) + h * D + cols[None, :]
        acc += tl.load(K + ptr).to(tl.float32) + tl.load(V + ptr).to(tl.float32)
    tl.store(Out + split * H + h, tl.sum(acc))


def per_call_us(fns):
    for f in fns:
        f()
    replay = graph_replay(fns)
    return time_cuda(replay, repeats=30, back_to_back=True).median_ms * 1e3 / len(fns)


def main():
    print(torch.cuda.get_device_name())
    copy_bw = measure_copy_bandwidth()
    b, kv, H, D = 1, 8192, 16, 128
    nbytes = 2 * b * kv * H * D * 2
    sets = _decode_inputs(b, kv, H, H, D, 4)
    seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {nbytes / 1e6:.1f} MB a call, {len(sets)} caches")
    def decode_calls():
        return [lambda q=q, k=k, v=v: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, backend="triton")
                for q, k, v in sets]

    def contiguous_calls(progs, per, out):
        return [lambda k=k, v=v: _stream_contig[(progs,)](k, v, out, per, BLOCK=4096) for _, k, v in sets]

    def pattern_calls(splits, warps, out):
        return [lambda k=k, v=v: _stream_heads[(splits, H)](k, v, out, kv // splits, H=H, D=D, BLOCK_N=64,
                                                            num_warps=warps) for _, k, v in sets]

    for rnd in range(2):
        rows = [("ours decode", per_call_us(decode_calls()))]
        with programmatic_launch(True, early_trigger=True):
            rows.append(("ours decode, PDL", per_call_us(decode_calls())))
        n = kv * H * D
        for progs in (sms, 2 * sms, 4 * sms, 8 * sms):
            per = triton.cdiv(triton.cdiv(n, progs), 4096) * 4096  # elements a program, whole blocks
            if n % per:
                continue
            rows.append((f"contiguous read, {n // per} programs",
                         per_call_us(contiguous_calls(n // per, per, torch.empty(n // per, device="cuda")))))
        for splits, warps in ((16, 4), (16, 8), (8, 4), (32, 4)):
            rows.append((f"decode pattern read, {splits} splits x {H} heads, {warps} warps",
                         per_call_us(pattern_calls(splits, warps, torch.empty(splits * H, device="cuda")))))
        dst = [torch.empty_like(k) for _, k, _ in sets]
        rows.append(("copy of K alone (bytes read + written = the call's bytes)",
                     per_call_us([lambda k=k, d=d: d.copy_(k) for (_, k, _), d in zip(sets, dst)])))
        print(f"round {rnd}:")
        for name, us in rows:
            print(f"  {name:70s} {us:7.1f} us  {nbytes / (us * 1e-6) / copy_bw:.3f} of copy bw")


if __name__ == "__main__":
    main()
