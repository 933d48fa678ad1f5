"""The decode attention's key prefetch before its PDL wait (``attention_decode._prefetch_kv``) on and off, in one
process, alternating: ms/step of the decode step as `bench generate` times it, GPT-2 124M and LLaMA-1.1B at
batch 1 and 16, prompt 128. Session 11 measured no gain from it at batch 1, and GPT-2's batch-16 step went
from 0.50 to 0.565 ms in the run that added it (other changes rode along).

    PYTHONPATH=.:kernels python scripts/profile/decode_prefetch_ab.py   # on a Hopper GPU, from the repo root
"""

import importlib

import torch

from flash_models.bench.generate import MODELS, _per_step_ms
from flash_models.checkpoint import create_model
from flash_models.generation.engine import clear_decode_pool

attention_decode = importlib.import_module("flash_kernels.attention_decode")
ROUNDS = 2


def main():
    print(torch.cuda.get_device_name())
    print("| model | batch | round | prefetch ms/step | no prefetch ms/step |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for name in ("gpt2-124m", "llama-1.1b"):
            preset, overrides = MODELS[name]
            torch.manual_seed(0)
            model = create_model(preset, dtype=torch.bfloat16, device="cuda", **overrides).eval()
            for batch in (1, 16):
                ids = torch.randint(100, 20000, (batch, 128), device="cuda")

                def generate(n, ids=ids, model=model):
                    return model.generate(ids, max_new_tokens=n, eos_token_id=[])

                for rnd in range(ROUNDS):
                    times = []
                    for prefetch in (True, False):
                        attention_decode._prefetch_kv = lambda device, on=prefetch: on
                        clear_decode_pool(model)  # the pooled graphs were captured with the other choice
                        times.append(_per_step_ms(generate, 256, 3, torch.device("cuda")))
                    print(f"| {name} | {batch} | {rnd} | {times[0]:.3f} | {times[1]:.3f} |", flush=True)
            clear_decode_pool(model)


if __name__ == "__main__":
    main()
