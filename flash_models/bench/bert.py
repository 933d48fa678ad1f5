"""`flash-models bench bert`: our BertModel vs HF transformers' BertModel (sdpa), same weights, same process.

Grid: BERT-base and BERT-large shapes, bf16, sequence length 128 and 512, 0% and ~50% padding (right padded,
row lengths spread uniformly), inference (forward under inference_mode) and training (forward + backward of a
loss on the real tokens' hidden states; no optimizer step, the same for both). Reports useful tokens/s (real
tokens only: padding is work HF does and we skip), speedup over HF, peak memory, and our outputs' max
difference from HF's on the real tokens. Both modes also run as "ours+graphs" (on CUDA; the dry run takes the
same code path eagerly): inference with the encoder replayed from CUDA graphs per shape bucket
(``BertModel.use_cuda_graphs``), training with the rows packed on the host into a bucket and forward +
backward replayed from CUDA graphs, as ``train.cuda_graphs`` runs text classification (no peak memory: a
graph's memory is its private pool). The sides of a grid point are timed in interleaved rounds (``--rounds``),
each reporting its best.

Mode "finetune" is the user's path: BertForSequenceClassification (2 labels, fp32 weights, ours and HF's from
the same random init) fine-tuned in the plain loop a tutorial shows, eager: ``loss = model(ids,
attention_mask=mask, labels=labels).loss`` under bf16 autocast, ``loss.backward()`` (on the calling thread
for ours, as its forward arranges; HF's where torch runs it), a fused AdamW step and ``zero_grad``, on the
same padded batches. Its max_diff compares the classifier logits before any step.

``--dry-run`` runs the whole script on tiny shapes on the CPU (wall-clock timer, fp32 and HF sdpa): it checks
the code path, not speed.
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import torch
import transformers

from ..registry import get_preset
from ..testing import ours_from_hf
from ..train.classification import collate_packed_classification
from ..runtime.train_graphs import GraphedLoss
from .harness import BenchResult, add_rounds_argument, best_of_rounds, peak_memory_bytes
from .measure import backward_and_drop_grads, time_fn

log = logging.getLogger(__name__)

COLUMNS = ["model", "seq", "batch", "padding", "mode", "impl", "ms", "useful_tok_s", "speedup", "peak_MiB", "max_diff"]

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


def build_classifier_pair(preset: str, *, device, dry_run: bool):
    """HF BertForSequenceClassification (sdpa, 2 labels) with random weights, and ours with the same weights, in
    float32: the fine-tuning loop autocasts."""
    spec = get_preset(preset)
    fields = {**spec.hf_config, **(TINY if dry_run else {}), "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
              "num_labels": 2, "architectures": ["BertForSequenceClassification"]}
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification._from_config(transformers.BertConfig(**fields), attn_implementation="sdpa")
    ours = ours_from_hf(hf, attn_impl="auto")
    return hf.to(device=device), ours.to(device=device)


def _finetune_step(model, ids, mask, labels):
    """One step of the plain fine-tuning loop (see the module docstring), with the model's own fused AdamW."""
    device = ids.device
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _finetune_sides(classifiers, initial, ids, mask, labels) -> tuple[dict, dict]:
    """({side: (model, step)}, {side: max_diff}) of the fine-tuning mode. Each grid point starts from the
    classifiers' ``initial`` weights (an earlier point's steps moved the two apart, each by its own rounding),
    and the difference of our classifier logits from HF's is taken there, before any step."""
    hf, ours = classifiers
    for model, state in zip(classifiers, initial):
        model.load_state_dict(state)
    with torch.inference_mode():
        diff = (ours.eval()(ids, attention_mask=mask).logits.float()
                - hf.eval()(input_ids=ids, attention_mask=mask).logits.float()).abs().max().item()
    sides = {name: (model.train(), _finetune_step(model, ids, mask, labels)) for name, model in (("HF sdpa", hf), ("ours", ours))}
    return sides, {"ours": diff}


@torch.inference_mode()
def _max_diff(ours, hf, ids, mask) -> float:
    """Largest difference of our last hidden states from HF's, over the real tokens."""
    real = mask.bool()
    ours_out = ours(ids, attention_mask=mask).last_hidden_state[real].float()
    return (ours_out - hf(input_ids=ids, attention_mask=mask).last_hidden_state[real].float()).abs().max().item()


def step_fns(model, ids, mask, *, is_hf: bool):
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


def _packed_bucket(ids, mask, seq: int) -> dict:
    """The right-padded rows packed on the host into a bucket, as ``train.cuda_graphs`` collates text rows
    (``collate_packed_classification``): the real tokens first, in row order, then the padding sequences."""
    rows = [{"input_ids": row[:n].tolist(), "labels": 0, "pad_id": 0} for row, n in zip(ids.cpu(), mask.sum(1).tolist())]
    batch = collate_packed_classification(rows, seq_len=seq)
    del batch["labels"]
    return {k: v.to(ids.device) for k, v in batch.items()}


def graphed_training(model, ids, mask, seq: int):
    """Our training step on the packed bucket, forward + backward of the eager step's loss replayed from CUDA
    graphs through the trainer's graphed loss (``runtime.train_graphs.GraphedLoss``); off CUDA, run eagerly."""
    batch, useful = _packed_bucket(ids, mask, seq), int(mask.sum())

    def loss_of(m, b):
        return m(**b, max_seqlen=seq).last_hidden_state[0, :useful].float().square().mean()

    graphed = GraphedLoss(model, loss_of) if ids.is_cuda else None
    return lambda: backward_and_drop_grads(graphed(batch) if graphed else loss_of(model, batch), model)


@torch.inference_mode()
def _packed_max_diff(ours, hf, ids, mask, seq: int) -> float:
    """_max_diff for the packed bucket's forward (what the graphed training step replays)."""
    real = mask.bool()
    packed = ours(**_packed_bucket(ids, mask, seq), max_seqlen=seq).last_hidden_state[0, : int(real.sum())].float()
    return (packed - hf(input_ids=ids, attention_mask=mask).last_hidden_state[real].float()).abs().max().item()


def _sides(mode: str, hf, ours, graphed, ids, mask, seq: int) -> dict:
    """{side: (model, step)} for one mode, each model already in that mode. "ours+graphs" is a second instance
    of ours (same weights), so that its captured graphs stay while the eager side is timed between them:
    inference replays the encoder per shape bucket (``BertModel.use_cuda_graphs``), training the trainer's
    graphed loss over the packed bucket. Off CUDA both run eagerly (the dry run checks the code path)."""
    training = mode == "training"
    for model in (hf, ours, graphed):
        model.train(training)
    graphed.use_cuda_graphs(not training)
    sides = {}
    for name, model in (("HF sdpa", hf), ("ours", ours), ("ours+graphs", graphed)):
        inference_step, training_step = step_fns(model, ids, mask, is_hf=model is hf)
        if model is graphed and training:
            training_step = graphed_training(model, ids, mask, seq)
        sides[name] = (model, training_step if training else inference_step)
    return sides


def bench(result: BenchResult, *, presets, seqlens, paddings, modes, tokens: int, repeats: int, dtype, device,
          dry_run: bool, rounds: int = 3):
    """Every side of a grid point is timed in ``rounds`` interleaved rounds, each reporting its best
    (``harness.best_of_rounds``)."""
    cuda = device.type == "cuda"
    for preset in presets:
        hf, ours = build_pair(preset, dtype=dtype, device=device, dry_run=dry_run)
        graphed = copy.deepcopy(ours)
        classifiers = build_classifier_pair(preset, device=device, dry_run=dry_run) if "finetune" in modes else None
        initial = [{k: v.clone() for k, v in m.state_dict().items()} for m in classifiers] if classifiers else None
        vocab = hf.config.vocab_size
        for seq in seqlens:
            batch = max(1, tokens // seq)
            for padding in paddings:
                ids, mask = make_batch(batch, seq, padding, vocab, device)
                useful = int(mask.sum())
                diff = _max_diff(ours, hf, ids, mask)
                labels = torch.randint(0, 2, (batch,), device=device, generator=torch.Generator(device).manual_seed(seq))
                for mode in modes:
                    if mode == "finetune":
                        sides, diffs = _finetune_sides(classifiers, initial, ids, mask, labels)
                    else:
                        sides = _sides(mode, hf, ours, graphed, ids, mask, seq)
                        diffs = {"ours": diff, "ours+graphs": _packed_max_diff(graphed, hf, ids, mask, seq)
                                 if mode == "training" else _max_diff(graphed, hf, ids, mask)}
                    warmup = 5 if cuda else 1
                    times = best_of_rounds({name: lambda step=step: time_fn(step, device=device, warmup=warmup,
                                                                             repeats=repeats).median_ms
                                            for name, (_, step) in sides.items()}, rounds)
                    for name, (model, step) in sides.items():
                        ms = times[name]
                        # A graph's memory is its private pool, allocated at capture, which a replay's peak misses.
                        peak = peak_memory_bytes(step) / 2**20 if cuda and model is not graphed else None
                        result.add(model=preset, seq=seq, batch=batch, padding=f"{1 - useful / mask.numel():.0%}",
                                   mode=mode, impl=name, ms=ms, useful_tok_s=useful / (ms * 1e-3), peak_MiB=peak,
                                   speedup=None if name == "HF sdpa" else times["HF sdpa"] / ms, max_diff=diffs.get(name))
                    log.info("%s S=%d pad=%.0f%% %s: %s", preset, seq, 100 * padding, mode,
                             ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()))
        graphed.use_cuda_graphs(False)
        del hf, ours, graphed, classifiers, initial
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(prog="flash-models bench bert", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results", help="directory for bert.json")
    p.add_argument("--models", default="bert-base,bert-large", help="registered BERT presets")
    p.add_argument("--seqlens", default="128,512")
    p.add_argument("--paddings", default="0,0.5", help="fractions of padding tokens")
    p.add_argument("--modes", default="inference,training,finetune")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seq_len of every batch")
    p.add_argument("--repeats", type=int, default=20)
    add_rounds_argument(p, "grid point")
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
          modes=args.modes.split(","), tokens=tokens, repeats=repeats, dtype=dtype, device=device, dry_run=args.dry_run,
          rounds=args.rounds)
    out = Path(args.out)
    result.write_json(out / "bert.json")
    print(result.markdown(COLUMNS))
    print(f"\n{result.env}")
    return result


if __name__ == "__main__":
    main()
