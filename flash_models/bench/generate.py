"""`flash-models bench generate`: decode speed of ours against HF generate (dynamic cache) and HF generate
with a static cache + torch.compile, in one process on one GPU, on random-init bf16 models.

Models: GPT-2 124M and a LLaMA of ~1.1B (TinyLlama shape). Batch 1 and 16, prompts of 128 and 512 tokens,
256 new tokens, greedy, no EOS. ms/token = the median over repeats of (a 256-token generate's time - the time
of the 1-token generate right after it) / 255, so the prefill is left out on both sides. The bandwidth bound is
the weight bytes plus the mean KV-cache bytes read per step, over the measured device copy bandwidth.

``--dry-run`` runs the whole script on tiny fp32 models on the CPU (wall clock, no static+compile peer): it
checks the code, not speed.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
import transformers

from ..checkpoint import create_model
from .harness import BenchResult, measure_copy_bandwidth

log = logging.getLogger(__name__)

MODELS = {
    "gpt2-124m": ("gpt2", {}),
    "llama-1.1b": ("llama-1b", {}),
}
# Tiny sizes for --dry-run, per preset.
DRY_RUN_SIZES = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4),
    "llama-1b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
}
COLUMNS = ["model", "batch", "prompt", "impl", "ms_per_step", "tokens_per_s", "bound_ms", "frac_of_bound", "x_vs_hf", "x_vs_hf_static"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _seconds(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _per_step_ms(generate, new_tokens: int, repeats: int, device: torch.device) -> float:
    """One decode step's time: a whole generate less its prefill (a generate of one token), timed back to back in
    each repeat and the median of those differences taken, so that a drift in the host's speed between the two
    timings cancels rather than lands in one of them (two separate medians could even differ the wrong way
    round on a busy host). Raises where the decode steps still do not show above the timing's noise."""
    generate(new_tokens)  # warm-up: compilation, graph capture, autotuning
    generate(1)
    differences = [_seconds(lambda: generate(new_tokens), device) - _seconds(lambda: generate(1), device)
                   for _ in range(repeats)]
    per_step = statistics.median(differences) / (new_tokens - 1)
    if per_step <= 0:
        raise RuntimeError(f"the {new_tokens - 1} decode steps took no measurable time beyond the prefill "
                           f"(differences {differences}); raise --new-tokens or --repeats, or run on an idle machine")
    return per_step * 1e3


def _hf_twin(ours):
    """The HF model with our model's weights (through save_pretrained's canonical layout, in memory)."""
    from ..checkpoint.remap import ours_to_hf
    from ..registry import rules_for

    with torch.device(ours.device):
        hf = transformers.AutoModelForCausalLM.from_config(ours.config.to_hf(), dtype=ours.dtype, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(ours_to_hf(ours.state_dict(), rules_for(ours.config)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # only a tied head may be absent
        raise RuntimeError(f"HF twin does not fit: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf.generation_config.eos_token_id = None  # random weights: never stop early, on either side
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def _bound_ms(model, batch: int, prompt: int, new_tokens: int, bandwidth: float | None) -> float:
    if bandwidth is None:
        return float("nan")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    att = model.decoder_config.attention
    kv_per_token = 2 * model.decoder_config.num_layers * att.num_kv_heads * att.head_dim * model.dtype.itemsize
    mean_len = prompt + new_tokens / 2
    return (weights + batch * mean_len * kv_per_token) / bandwidth * 1e3


def _bench_model(result: BenchResult, name: str, *, batches, prompts, new_tokens: int, repeats: int, peers,
                 bandwidth: float | None, device: torch.device, dtype: torch.dtype, dry_run: bool) -> None:
    preset, overrides = MODELS[name]
    if dry_run:
        overrides = {**overrides, **DRY_RUN_SIZES[preset]}
    torch.manual_seed(0)
    ours = create_model(preset, dtype=dtype, device=device, **overrides).eval()
    hf = _hf_twin(ours) if {"hf", "hf_static"} & set(peers) else None
    sides = {"ours": lambda ids, n: ours.generate(ids, max_new_tokens=n, eos_token_id=[])}
    if "ours-pdl" in peers:  # the decode step without programmatic dependent launch (flash_kernels._pdl)
        sides["ours-pdl"] = lambda ids, n: ours.generate(ids, max_new_tokens=n, eos_token_id=[],
                                                         programmatic_launch=False)
    if "hf" in peers:
        sides["hf"] = lambda ids, n: hf.generate(ids, max_new_tokens=n, do_sample=False)
    if "hf_static" in peers:
        sides["hf_static"] = lambda ids, n: hf.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
    for batch in batches:
        for prompt in prompts:
            ids = torch.randint(100, 20000, (batch, prompt), device=device)
            bound = _bound_ms(ours, batch, prompt, new_tokens, bandwidth)
            times = {side: _per_step_ms(lambda n, fn=fn: fn(ids, n), new_tokens, repeats, device) for side, fn in sides.items()}
            for impl, ms in times.items():
                result.add(model=name, batch=batch, prompt=prompt, impl=impl, ms_per_step=ms, tokens_per_s=batch / ms * 1e3,
                           bound_ms=bound, frac_of_bound=bound / ms, x_vs_hf=times.get("hf", float("nan")) / ms,
                           x_vs_hf_static=times.get("hf_static", float("nan")) / ms)
            log.info("%s b%d p%d: %s", name, batch, prompt, {k: round(v, 3) for k, v in times.items()})


def run(models: list[str], batches: list[int], prompts: list[int], new_tokens: int, repeats: int, peers: list[str],
        *, dry_run: bool = False) -> BenchResult:
    result = BenchResult("generate")
    if dry_run:
        device, dtype, bandwidth = torch.device("cpu"), torch.float32, None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench generate needs a CUDA GPU (or --dry-run to check the script on a CPU)")
        device, dtype, bandwidth = torch.device("cuda"), torch.bfloat16, measure_copy_bandwidth()
        result.env["copy_bandwidth_GBps"] = bandwidth / 1e9
    for name in models:
        _bench_model(result, name, batches=batches, prompts=prompts, new_tokens=new_tokens, repeats=repeats,
                     peers=peers, bandwidth=bandwidth, device=device, dtype=dtype, dry_run=dry_run)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> BenchResult:
    parser = argparse.ArgumentParser(prog="flash-models bench generate", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prompts", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", nargs="*", default=None, choices=["hf", "hf_static", "ours-pdl"],
                        help="sides besides ours: HF generate (hf), HF with a static cache + compile (hf_static), "
                             "ours without programmatic dependent launch (ours-pdl); default: hf and hf_static (hf "
                             "only with --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="tiny fp32 models on the CPU: checks the code, not speed")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    peers = args.peers if args.peers is not None else (["hf"] if args.dry_run else ["hf", "hf_static"])
    result = run(args.models, args.batches, args.prompts, args.new_tokens, args.repeats, peers, dry_run=args.dry_run)
    result.env["dry_run"] = args.dry_run
    result.write_json(args.out / "generate.json")
    if "copy_bandwidth_GBps" in result.env:
        print(f"device {result.env['device']}, copy bandwidth {result.env['copy_bandwidth_GBps']:.0f} GB/s")
    print(result.markdown(COLUMNS))
    return result
