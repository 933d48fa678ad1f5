"""`flash-models bench bert`: our BertModel vs HF transformers' BertModel (sdpa), same weights, same process.

Grid: BERT-base and BERT-large shapes, bf16, sequence length 128 and 512, 0% and ~50% padding (right padded,
row lengths spread uniformly), inference (forward under inference_mode) and training (forward + backward of a
loss on the real tokens' hidden states; no optimizer step, the same for both). Reports useful tokens/s (real
tokens only: padding is work HF does and we skip), speedup over HF, peak memory, and our outputs' max
difference from HF's on the real tokens. On CUDA, inference also runs as "ours+graphs": the encoder replayed
from CUDA graphs per shape bucket (``BertModel.use_cuda_graphs``).

``--dry-run`` runs the whole script on tiny shapes on the CPU (wall-clock timer, fp32 and HF sdpa): it checks
the code path, not speed.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import transformers

from ..registry import get_preset
from ..testing import ours_from_hf
from .harness import BenchResult, peak_memory_bytes
from .utils import backward_and_drop_grads, time_fn

log = logging.getLogger(__name__)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=512)


def make_batch(batch: int, seq: int, padding: float, vocab: int, device, *, seed: int = 0):
    """Right-padded ids and mask; row lengths uniform in [(1 - 2p) S, S] so about a fraction p is padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    low = max(1, int(round(seq * (1 - 2 * padding))))
    lengths = torch.randint(low, seq + 1, (batch,), generator=gen) if padding > 0 else torch.full((batch,), seq)
    mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids.to(device), mask.to(device)


def build_pair(preset: str, *, dtype, device, dry_run: bool):
    """HF BertModel (sdpa) with random weights, and ours with the same weights."""
    spec = get_preset(preset)
    fields = {**spec.hf_config, **(TINY if dry_run else {}), "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    hf_config = transformers.BertConfig(**fields)
    torch.manual_seed(0)
    hf = transformers.BertModel._from_config(hf_config, attn_implementation="sdpa")
    ours = ours_from_hf(hf, attn_impl="auto")
    return hf.to(device=device, dtype=dtype), ours.to(device=device, dtype=dtype)


@torch.inference_mode()
def _max_diff(ours, hf, ids, mask) -> float:
    """Largest difference of our last hidden states from HF's, over the real tokens."""
    real = mask.bool()
    ours_out = ours(ids, attention_mask=mask).last_hidden_state[real].float()
    return (ours_out - hf(input_ids=ids, attention_mask=mask).last_hidden_state[real].float()).abs().max().item()


def _step_fns(model, ids, mask, *, is_hf: bool):
    real = mask.bool()

    def forward():
        out = model(input_ids=ids, attention_mask=mask) if is_hf else model(ids, attention_mask=mask)
        return out.last_hidden_state

    def inference():
        with torch.inference_mode():
            return forward()

    def training():
        return backward_and_drop_grads(forward()[real].float().square().mean(), model)

    return inference, training


def bench(result: BenchResult, *, presets, seqlens, paddings, modes, tokens: int, repeats: int, dtype, device, dry_run: bool):
    cuda = device.type == "cuda"
    for preset in presets:
        hf, ours = build_pair(preset, dtype=dtype, device=device, dry_run=dry_run)
        vocab = hf.config.vocab_size
        for seq in seqlens:
            batch = max(1, tokens // seq)
            for padding in paddings:
                ids, mask = make_batch(batch, seq, padding, vocab, device)
                useful = int(mask.sum())
                diff = _max_diff(ours, hf, ids, mask)
                for mode in modes:
                    sides = [("HF sdpa", hf), ("ours", ours)]
                    if cuda and mode == "inference":
                        sides.append(("ours+graphs", ours))  # BertModel.use_cuda_graphs
                    times = {}
                    for name, model in sides:
                        if name == "ours+graphs":
                            model.use_cuda_graphs(True)
                        inference, training = _step_fns(model, ids, mask, is_hf=model is hf)
                        fn = inference if mode == "inference" else training
                        model.train(mode == "training")
                        ms = time_fn(fn, device=device, warmup=5 if cuda else 1, repeats=repeats).median_ms
                        peak = peak_memory_bytes(fn) / 2**20 if cuda else None
                        if name == "ours+graphs":
                            graphed_diff = _max_diff(ours, hf, ids, mask)
                            model.use_cuda_graphs(False)
                        times[name] = ms
                        result.add(model=preset, seq=seq, batch=batch, padding=f"{1 - useful / mask.numel():.0%}",
                                   mode=mode, impl=name, ms=ms, useful_tok_s=useful / (ms * 1e-3), peak_MiB=peak,
                                   speedup=None if model is hf else times["HF sdpa"] / ms,
                                   max_diff=None if model is hf else graphed_diff if name == "ours+graphs" else diff)
                    log.info("%s S=%d pad=%.0f%% %s: %s", preset, seq, 100 * padding, mode,
                             ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
        del hf, ours
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(prog="flash-models bench bert", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results", help="directory for bert.json")
    p.add_argument("--models", default="bert-base,bert-large", help="registered BERT presets")
    p.add_argument("--seqlens", default="128,512")
    p.add_argument("--paddings", default="0,0.5", help="fractions of padding tokens")
    p.add_argument("--modes", default="inference,training")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seq_len of every batch")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU in fp32: checks the code, not speed")
    args = p.parse_args(argv)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        seqlens, tokens, repeats = [16, 32], 64, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench bert needs a CUDA GPU (or --dry-run to check the script on a CPU)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        seqlens, tokens, repeats = [int(s) for s in args.seqlens.split(",")], args.tokens, args.repeats
    result = BenchResult(area="bert")
    result.env.update(dtype=str(dtype).removeprefix("torch."), dry_run=args.dry_run, tokens_per_batch=tokens)
    bench(result, presets=args.models.split(","), seqlens=seqlens, paddings=[float(x) for x in args.paddings.split(",")],
          modes=args.modes.split(","), tokens=tokens, repeats=repeats, dtype=dtype, device=device, dry_run=args.dry_run)
    out = Path(args.out)
    result.write_json(out / "bert.json")
    print(result.markdown(["model", "seq", "batch", "padding", "mode", "impl", "ms", "useful_tok_s", "speedup", "peak_MiB", "max_diff"]))
    print(f"\n{result.env}")
    return result


if __name__ == "__main__":
    main()
