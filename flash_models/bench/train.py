"""`flash-models bench train`: training throughput, ours vs HF transformers, in one process on one GPU.

The ``loop:`` sides are the user's path, the headline: exactly the plain loop README.md shows (no Trainer),
``loss = model(ids, labels=ids).loss`` under bf16 autocast, ``loss.backward()`` (ours on the calling thread, as
its forward arranges), a fused AdamW step and ``zero_grad``, for ours and HF (sdpa) built from the
same random weights, and each through torch.compile; ``loop:hf+fm_attention`` is HF's model with our attention
(``flash_models.hf.register()``), compared with ``loop:hf``. The ``eval:`` sides run the forward a Trainer's evaluation
(or a reference model's scoring) runs on the same batches: eval mode, no grad, bf16 autocast, logits and loss; their
MFU counts forward FLOPs. Each side runs its steps back to back, with no host read in between, and is timed over
the whole window.

The other sides run the same ``flash_models.train.Trainer`` step (same synthetic batches, same fused AdamW, same
global batch, bf16 autocast, gradient clipping) and differ only in the model: ours (fused kernels, flash
attention), HF with sdpa, and each with torch.compile; ours+graphs replays each forward+backward from CUDA
graphs (``train.cuda_graphs``). Steps are timed as ``fit`` runs them (``Trainer.iter_steps``: the next step is
queued before the previous loss is read), every side alike.

Cases are real checkpoints' shapes with their real vocabularies: GPT-2 124M (16x1024) and 355M (8x1024) at
50257, LLaMA 1.1B (4x2048) at 32000, SmolLM2-135M and 360M (8x2048) at 49152, Qwen2-0.5B (4x2048) at 151936.
The ``@50304`` cases pad GPT-2's vocabulary in the config (not a real checkpoint's): extra rows, labelled. The
``@sft`` cases feed the loop an SFT collator's batches: rows right-padded to random lengths (30% padding on
average), the attention mask, labels -100 at the padding; their tokens/s counts the real tokens.
Reported: tokens/s, MFU (6N + 12*L*D*S FLOPs per token against a measured bf16 matmul peak), peak memory.

    flash-models bench train [--cases gpt2,llama-1b] [--sides loop:ours,loop:hf] [--steps 20] [--out bench-train.json]
    flash-models bench train --dry-run      # tiny shapes on the CPU: exercises every code path, times nothing real
    flash-models bench train --hf-trainer   # the same models inside transformers.Trainer (bench/train_hf.py)
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from dataclasses import dataclass

import torch
import transformers

from ..checkpoint.loader import build_model, create_model
from ..checkpoint.remap import hf_to_ours
from ..registry import rules_for
from ..registry import get_preset
from ..train import Trainer, load_config
from ..train.metrics import flops_per_token, measure_matmul_peak
from .harness import BenchResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Case:
    preset: str
    batch: int
    seq_len: int
    overrides: tuple = ()
    note: str = ""  # what sets the case apart from the real checkpoint, shown in the table
    padding: float = 0.0  # mean share of right padding per row (labels -100 there): an SFT batch; loop sides only


SMOLLM2_360M = (("hidden_size", 960), ("intermediate_size", 2560), ("num_hidden_layers", 32),
                ("num_attention_heads", 15), ("num_key_value_heads", 5))
PADDED = "vocabulary padded to 50304 in the config (not the checkpoint's)"
SFT = "right-padded rows, ~30% padding with labels -100 there (an SFT collator's batch); tokens/s counts real tokens"
CASES = {
    "gpt2": Case("gpt2", 16, 1024),
    "gpt2-medium": Case("gpt2-medium", 8, 1024),
    "llama-1b": Case("llama-1b", 4, 2048),
    "smollm2-135m": Case("smollm2-135m", 8, 2048),
    "smollm2-360m": Case("smollm2-135m", 8, 2048, SMOLLM2_360M),
    "qwen2-0.5b": Case("qwen2-0.5b", 4, 2048),
    "llama-1b@sft": Case("llama-1b", 4, 2048, note=SFT, padding=0.3),
    "smollm2-360m@sft": Case("smollm2-135m", 8, 2048, SMOLLM2_360M, note=SFT, padding=0.3),
    "gpt2@50304": Case("gpt2", 16, 1024, (("vocab_size", 50304),), note=PADDED),
    "gpt2-medium@50304": Case("gpt2-medium", 8, 1024, (("vocab_size", 50304),), note=PADDED),
}
_DRY_LLAMA = (("num_hidden_layers", 2), ("hidden_size", 64), ("intermediate_size", 96), ("num_attention_heads", 4),
              ("num_key_value_heads", 2), ("vocab_size", 301))
DRY_CASES = {  # odd vocabularies, as the real ones: the padded LM head runs
    "gpt2": Case("gpt2", 2, 32, (("n_layer", 2), ("n_embd", 64), ("n_head", 4), ("vocab_size", 257))),
    "llama-1b": Case("llama-1b", 2, 32, _DRY_LLAMA),
    "llama-1b@sft": Case("llama-1b", 2, 32, _DRY_LLAMA, note=SFT, padding=0.3),
}
LOOP_SIDES = ("loop:ours", "loop:ours+compile", "loop:hf", "loop:hf+compile", "loop:hf+fm_attention", "eval:ours",
              "eval:hf")
SIDES = LOOP_SIDES + ("ours", "ours+graphs", "ours+compile", "hf", "hf+compile")
COLUMNS = ["case", "side", "vocab", "batch", "seq", "step_ms", "tokens_per_s", "mfu", "peak_GiB", "reserved_GiB",
           "x_vs_hf", "x_vs_hf_compile", "note"]


def no_dropout(preset: str) -> dict:
    keys = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), "llama": ("attention_dropout",),
            "qwen2": ("attention_dropout",)}
    return {k: 0.0 for k in keys[get_preset(preset).model_type]}


def hf_config_for(case: Case):
    spec = get_preset(case.preset)
    overrides = {**no_dropout(case.preset), **dict(case.overrides)}
    return transformers.AutoConfig.for_model(spec.model_type, **{**spec.hf_config, **overrides})


def build(side: str, case: Case, device: torch.device) -> torch.nn.Module:
    if side.startswith("ours"):
        return create_model(case.preset, **{**no_dropout(case.preset), **dict(case.overrides)})
    return transformers.AutoModelForCausalLM.from_config(hf_config_for(case), attn_implementation="sdpa")


def same_weights_model(side: str, case: Case, device: torch.device) -> torch.nn.Module:
    """The ``loop:`` sides' model, in training mode: HF's random init from a fixed seed, so that ours (the same
    tensors through the checkpoint rules, as from_pretrained loads them) and HF's start from the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config_for(case), attn_implementation="sdpa")
    if side == "loop:hf+fm_attention":
        from ..hf import register

        hf.set_attn_implementation(register())
    if side.startswith(("loop:hf", "eval:hf")):
        return hf.train()
    ours = build_model(hf.config, device=device)
    ours.load_state_dict(hf_to_ours(hf.state_dict(), rules_for(ours.config)), strict=True)
    return ours.train()


class LoopStep:
    """One step of the plain loop README.md shows, for a ``loop:`` side: call it with the step's index."""

    trains = True  # with an optimizer step

    def __init__(self, side: str, case: Case, device: torch.device):
        self.model = same_weights_model(side, case, device)
        self.flops_per_token = flops_per_token(self.model, case.seq_len)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda") if self.trains else None
        if side.endswith("+compile"):
            self.model = torch.compile(self.model)
        self.device = device
        gen = torch.Generator(device).manual_seed(1)
        vocab = hf_config_for(case).vocab_size
        self.batches = [_batch(case, vocab, device, gen) for _ in range(4)]
        self.tokens_per_step = sum(int(b.get("attention_mask", b["input_ids"]).bool().sum()) for b in self.batches) / 4

    def __call__(self, i: int) -> torch.Tensor:
        batch = self.batches[i % len(self.batches)]
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class EvalStep(LoopStep):
    """The forward of an ``eval:`` side: eval mode, no grad, the logits and the loss."""

    trains = False

    def __init__(self, side: str, case: Case, device: torch.device):
        super().__init__(side, case, device)
        self.model.eval()
        self.flops_per_token /= 3  # a forward: a third of a training step's FLOPs

    def __call__(self, i: int) -> torch.Tensor:
        batch = self.batches[i % len(self.batches)]
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16):
            return self.model(**batch).loss


def loop_step(side: str, case: Case, device: torch.device) -> LoopStep:
    """The callable step of a ``loop:`` or ``eval:`` side (its argument: the step's index)."""
    return (EvalStep if side.startswith("eval:") else LoopStep)(side, case, device)


def _batch(case: Case, vocab: int, device: torch.device, gen: torch.Generator) -> dict:
    """One step's keyword arguments: random tokens as their own labels; for an SFT case, rows right-padded to
    random lengths (a mean share ``case.padding`` of padding), with the attention mask and labels -100 there."""
    ids = torch.randint(0, vocab, (case.batch, case.seq_len), device=device, generator=gen)
    if not case.padding:
        return {"input_ids": ids, "labels": ids}
    shortest = max(1, round(case.seq_len * (1 - 2 * case.padding)))
    lengths = torch.randint(shortest, case.seq_len + 1, (case.batch, 1), device=device, generator=gen)
    mask = (torch.arange(case.seq_len, device=device) < lengths).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def measure_loop(side: str, case: Case, device: torch.device, *, steps: int, warmup: int, peak_flops: float) -> dict:
    """The plain loop README.md shows, timed over ``steps`` back-to-back steps after ``warmup`` (compilation).
    The warmup takes each of the side's batches at least once: an SFT batch runs its real tokens, a count each
    batch has its own, and the first launch at a new count (a kernel loaded, a specialization compiled) belongs
    to no timed step."""
    step = loop_step(side, case, device)
    for i in range(max(warmup, len(step.batches))):
        step(i)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    _sync(device)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    row = _row(side, case, step_ms, step.flops_per_token, peak_flops, device, tokens=step.tokens_per_step,
               final_loss=loss.item())
    del step, loss
    _release(device)
    return row


def _row(side: str, case: Case, step_ms: float, fpt: float, peak_flops: float, device: torch.device, *,
         tokens: float | None = None, **extra) -> dict:
    """A table row; ``tokens``: the real tokens of a step (default: the whole batch)."""
    tokens_per_s = (case.batch * case.seq_len if tokens is None else tokens) / (step_ms * 1e-3)
    # A graph's activations live in its private pool, allocated once at capture: replays allocate nothing, so
    # the allocated peak misses them. The reserved peak counts the pool.
    peak_mem, reserved = ((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if device.type == "cuda"
                          else (0, 0))
    return {"side": side, "vocab": hf_config_for(case).vocab_size, "batch": case.batch, "seq": case.seq_len,
            "step_ms": step_ms, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * fpt / peak_flops,
            "peak_GiB": peak_mem / 2**30, "reserved_GiB": reserved / 2**30, "flops_per_token": fpt,
            "note": case.note, **extra}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def trainer_for(side: str, case: Case, device: torch.device) -> Trainer:
    if side in LOOP_SIDES or side not in SIDES:
        raise ValueError(f"trainer_for takes a Trainer side ({[s for s in SIDES if s not in LOOP_SIDES]}), not {side!r}: "
                         "a loop: side runs through LoopStep")
    cfg = load_config({
        "model": {"name": case.preset},
        "data": {"format": "synthetic", "seq_len": case.seq_len, "packing": "stream",
                 "synthetic_tokens": case.batch * case.seq_len * 8},
        "optim": {"lr": 1e-4, "fused": None, "schedule": "constant", "grad_clip": 1.0},
        "train": {"max_steps": 10**6, "global_batch_size": case.batch, "micro_batch_size": case.batch,
                  "precision": "bf16_autocast", "compile": side.endswith("+compile"), "cuda_graphs": side.endswith("+graphs"),
                  "device": str(device),
                  "progress": False, "export": False, "output_dir": "/tmp/flash-models-bench-train"},
    })
    model = build(side, case, device)
    return Trainer(cfg, model=model)


def step_for(side: str, case: Case, device: torch.device):
    """A callable running one training step of ``side`` (its argument: the step's index), for the profilers in
    scripts/profile/."""
    if side in LOOP_SIDES:
        return loop_step(side, case, device)
    trainer = trainer_for(side, case, device)
    return lambda i: trainer.train_step()


def measure(side: str, case: Case, device: torch.device, *, steps: int, warmup: int, peak_flops: float) -> dict:
    if case.padding and side not in LOOP_SIDES:
        raise SystemExit(f"side {side!r}: the padded (SFT) cases run the loop: sides only (the Trainer's sides "
                         "train on packed synthetic tokens)")
    if side in LOOP_SIDES:
        return measure_loop(side, case, device, steps=steps, warmup=warmup, peak_flops=peak_flops)
    trainer = trainer_for(side, case, device)
    fpt = flops_per_token(trainer.model, case.seq_len)
    trainer.train_step()  # compile / autotune / capture outside the timed region
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # As fit() runs them: each step queued before the previous one's loss is read (Trainer.iter_steps).
    records = list(trainer.iter_steps(trainer.step + warmup + steps))[warmup:]
    # The mean, not the median: past the first record each interval runs from one step's end to the next's, so
    # the mean is the window's throughput. Pipelined steps alternate long and short intervals where the host
    # falls behind, and there the median read 4-9% under the window (GPT-2, H100, docs/benchmarks.md, session 23).
    step_ms = statistics.fmean(r["seconds"] for r in records) * 1e3
    row = _row(side, case, step_ms, fpt, peak_flops, device, final_loss=records[-1]["loss"])
    del trainer
    _release(device)
    return row


def main(argv: list[str] | None = None) -> BenchResult:
    parser = argparse.ArgumentParser(prog="flash-models bench train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=None, help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--steps", type=int, default=20, help="timed steps (their mean interval is reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="bench-train.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, eager sides only unless --sides says otherwise")
    parser.add_argument("--hf-trainer", action="store_true",
                        help="the sides inside transformers.Trainer instead (bench/train_hf.py): ours, hf, hf+liger, hf+fm_attention, hf+fm_attention+fused_ops")
    args = parser.parse_args(argv)
    if args.hf_trainer:
        from .train_hf import run

        args.sides = None if args.sides == ",".join(SIDES) else args.sides
        return run(args, cases=CASES, dry_cases=DRY_CASES, no_dropout=no_dropout)
    if args.dry_run:
        device, table = torch.device("cpu"), DRY_CASES
        sides = args.sides.split(",") if args.sides != ",".join(SIDES) else ["ours", "hf"]
        steps, warmup = min(args.steps, 2), min(args.warmup, 1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench train measures GPU throughput; without CUDA use --dry-run")
        device, table, sides, steps, warmup = torch.device("cuda"), CASES, args.sides.split(","), args.steps, args.warmup
    names = args.cases.split(",") if args.cases else list(table)
    unknown = [n for n in names if n not in table] + [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"unknown cases/sides {unknown}; cases: {list(table)}, sides: {list(SIDES)}")
    peak = measure_matmul_peak(device)
    result = BenchResult(area="train")
    result.env["matmul_peak_tflops"] = peak / 1e12
    result.env["dry_run"] = args.dry_run
    for name in names:
        rows = [{"case": name, **measure(side, table[name], device, steps=steps, warmup=warmup, peak_flops=peak)}
                for side in sides]
        base = {r["side"]: r["tokens_per_s"] for r in rows}
        for row in rows:
            prefix = row["side"].partition(":")[0] + ":" if row["side"] in LOOP_SIDES else ""  # loop: against loop:hf
            for column, side in (("x_vs_hf", prefix + "hf"), ("x_vs_hf_compile", prefix + "hf+compile")):
                if side in base:  # a ratio against a side that did not run is left blank, not NaN
                    row[column] = row["tokens_per_s"] / base[side]
            result.add(**row)
    print(result.markdown(COLUMNS))
    print(f"device: {result.env['device']}; matmul peak {peak / 1e12:.3g} TFLOP/s" + ("; DRY RUN: not a measurement" if args.dry_run else ""))
    result.write_json(args.out)
    return result


if __name__ == "__main__":
    main()
