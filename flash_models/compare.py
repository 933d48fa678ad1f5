"""``flash-models compare``: our model against transformers' on the same checkpoint, side by side."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import transformers

from .checkpoint import from_pretrained
from .checkpoint.gguf_file import gguf_hf_config
from .checkpoint.hub import is_gguf, resolve_model_dir
from .checkpoint.loader import resolve_dtype
from .checkpoint.tokenizer import load_tokenizer


def load_hf(source: str, *, dtype: torch.dtype, device: str):
    if is_gguf(source):
        path = Path(source)
        # transformers reads the tensors itself but drops metadata it does not map (a Qwen3's head dim, GPT-2's
        # context and MLP width, rope scaling): the architecture comes from the file as we read it, so the two
        # sides run the same model and differ only in their code.
        config = gguf_hf_config(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                                  dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(source), dtype=dtype)
    return model.to(device).eval()


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def compare(source: str, *, prompt: str, new_tokens: int = 32, dtype=None, device=None) -> dict:
    dtype, device = resolve_dtype(dtype), device or "cpu"
    tokenizer = load_tokenizer(source)
    ours = from_pretrained(source, dtype=dtype, device=device)
    hf = load_hf(source, dtype=dtype, device=device)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    ours_logits, hf_logits = ours(ids).logits.float(), hf(ids).logits.float()
    diff = (ours_logits - hf_logits).abs().max().item()
    ours_gen = ours.generate(ids, max_new_tokens=new_tokens, eos_token_id=[])
    hf_gen = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    same = torch.equal(ours_gen.cpu(), hf_gen.cpu())
    ours_s, hf_s = _median_seconds(lambda: ours(ids)), _median_seconds(lambda: hf(ids))
    result = {"max_abs_logit_diff": diff, "greedy_identical": same, "ours_forward_ms": ours_s * 1e3, "hf_forward_ms": hf_s * 1e3}
    print(f"model:                    {source}  ({dtype}, {device}, {ids.shape[1]} prompt tokens)")
    print(f"max |logits ours - HF|:   {diff:.3g}")
    print(f"greedy {new_tokens} tokens identical: {'yes' if same else 'NO'}")
    print(f"forward time ours / HF:   {ours_s * 1e3:.1f} ms / {hf_s * 1e3:.1f} ms  ({hf_s / ours_s:.2f}x)")
    if not same:
        print("ours:", repr(tokenizer.decode(ours_gen[0, ids.shape[1]:])))
        print("HF:  ", repr(tokenizer.decode(hf_gen[0, ids.shape[1]:])))
    return result
