"""The split-KV schedule's minimum chunk (``attention_decode.DECODE_MIN_CHUNK``) against what it costs: the
decode step of LLaMA-1.1B and GPT-2 at batch 1 (ms/step as `bench generate` times it: CUDA graphs, PDL) and
decode attention alone at batch 1 over 2k and 8k keys (fraction of the copy bandwidth, as `bench attention`).

The split plan follows the cache's capacity, not its filled length (a captured graph fixes the grid), and a
generation cache is rounded up to 256 positions: with 256-key chunks, a 128-token prompt decodes with one or
two splits whose programs walk up to four 64-key tiles one after the other, a latency chain of ~6.6 us per
LLaMA-1.1B layer on an H100 (session 12's `decode_kernels.py` excerpt). Smaller chunks put each tile in its
own program, at the price of more partials to merge.

    PYTHONPATH=.:kernels python scripts/profile/decode_chunk_sweep.py   # on a Hopper GPU, from the repo root
"""

import importlib

import torch

from flash_kernels import flash_attn_with_kvcache, programmatic_launch
from flash_models.bench.attention import _decode_inputs, _time_decode
from flash_models.bench.generate import MODELS, _per_step_ms
from flash_models.bench.harness import measure_copy_bandwidth
from flash_models.checkpoint import create_model
from flash_models.generation.engine import clear_decode_pool

attention_decode = importlib.import_module("flash_kernels.attention_decode")

CHUNKS = (64, 128, 256)
ROUNDS = 2
NEW_TOKENS = 256


def sweep_model(name: str):
    preset, overrides = MODELS[name]
    torch.manual_seed(0)
    model = create_model(preset, dtype=torch.bfloat16, device="cuda", **overrides).eval()
    for prompt in (128, 512):
        ids = torch.randint(100, 20000, (1, prompt), device="cuda")

        def generate(n):
            return model.generate(ids, max_new_tokens=n, eos_token_id=[])

        for rnd in range(ROUNDS):
            times = []
            for chunk in CHUNKS:
                attention_decode.DECODE_MIN_CHUNK = chunk
                clear_decode_pool(model)  # the pooled graphs hold the old grid
                times.append(_per_step_ms(generate, NEW_TOKENS, 3, torch.device("cuda")))
            print(f"| {name} | {prompt} | {rnd} | " + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)


def sweep_generate():
    print("| model | prompt | round | " + " | ".join(f"chunk {c} ms/step" for c in CHUNKS) + " |")
    print("|---|---|---|" + "---|" * len(CHUNKS))
    for name in ("llama-1.1b", "gpt2-124m"):
        sweep_model(name)
        torch.cuda.empty_cache()


def sweep_attention(copy_bw: float):
    heads, kv_heads, head_dim = 16, 16, 128  # as `bench attention` decodes
    print("| kv | round | " + " | ".join(f"chunk {c} frac" for c in CHUNKS) + " |")
    print("|---|---|" + "---|" * len(CHUNKS))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for kv in (2048, 8192):
        nbytes = 2 * kv * kv_heads * head_dim * 2
        sets = _decode_inputs(1, kv, heads, kv_heads, head_dim, max(1, min(8, -(-4 * l2 // nbytes))))
        seqlens = torch.full((1,), kv, dtype=torch.int32, device="cuda")

        def call(q, kc, vc):
            return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, backend="triton")

        for rnd in range(ROUNDS):
            fracs = []
            for chunk in CHUNKS:
                attention_decode.DECODE_MIN_CHUNK = chunk
                with programmatic_launch(early_trigger=True):  # batch 1, as generation runs it
                    _, graphed_ms = _time_decode(call, sets, repeats=50)
                fracs.append(nbytes / (graphed_ms * 1e-3) / copy_bw)
            print(f"| {kv} | {rnd} | " + " | ".join(f"{f:.3f}" for f in fracs) + " |", flush=True)


def main():
    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s")
    with torch.no_grad():
        sweep_generate()
        sweep_attention(copy_bw)


if __name__ == "__main__":
    main()
