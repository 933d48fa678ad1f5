"""`flash-models bench train`: training throughput, ours vs HF transformers, in one process on one GPU.

Every side runs the same ``flash_models.train.Trainer`` step (same synthetic batches, same fused AdamW, same
global batch, bf16 autocast) and differs only in the model: ours (fused kernels, flash attention), HF with
sdpa, and each with torch.compile; ours+graphs replays each forward+backward from CUDA graphs
(``train.cuda_graphs``). Steps are timed as ``fit`` runs them (``Trainer.iter_steps``: the next step is queued
before the previous loss is read), every side alike. Cases: GPT-2 124M at 16x1024, GPT-2 355M at 8x1024, LLaMA 1.1B at 4x2048.
Reported: tokens/s, MFU (6N + 12*L*D*S FLOPs per token against a measured bf16 matmul peak), peak memory.

    flash-models bench train [--cases gpt2,gpt2-medium,llama-1b] [--steps 20] [--out bench-train.json]
    flash-models bench train --dry-run      # tiny shapes on the CPU: exercises every code path, times nothing real
    flash-models bench train --hf-trainer   # the same models inside transformers.Trainer (bench/train_hf.py)
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
from dataclasses import dataclass

import torch
import transformers

from ..checkpoint.loader import create_model
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


CASES = {
    "gpt2": Case("gpt2", 16, 1024, (("vocab_size", 50304),)),
    "gpt2-medium": Case("gpt2-medium", 8, 1024, (("vocab_size", 50304),)),
    "llama-1b": Case("llama-1b", 4, 2048),
}
DRY_CASES = {
    "gpt2": Case("gpt2", 2, 32, (("n_layer", 2), ("n_embd", 64), ("n_head", 4), ("vocab_size", 512))),
    "llama-1b": Case("llama-1b", 2, 32, (("num_hidden_layers", 2), ("hidden_size", 64), ("intermediate_size", 96),
                                           ("num_attention_heads", 4), ("num_key_value_heads", 2), ("vocab_size", 512))),
}
SIDES = ("ours", "ours+graphs", "ours+compile", "hf", "hf+compile")
COLUMNS = ["case", "side", "batch", "seq", "step_ms", "tokens_per_s", "mfu", "peak_GiB", "reserved_GiB", "x_vs_hf", "x_vs_hf_compile"]


def no_dropout(preset: str) -> dict:
    keys = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), "llama": ("attention_dropout",)}
    return {k: 0.0 for k in keys[get_preset(preset).model_type]}


def build(side: str, case: Case, device: torch.device) -> torch.nn.Module:
    overrides = {**no_dropout(case.preset), **dict(case.overrides)}
    if side.startswith("ours"):
        return create_model(case.preset, **overrides)
    spec = get_preset(case.preset)
    hf_config = transformers.AutoConfig.for_model(spec.model_type, **{**spec.hf_config, **overrides})
    return transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")


def trainer_for(side: str, case: Case, device: torch.device) -> Trainer:
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


def measure(side: str, case: Case, device: torch.device, *, steps: int, warmup: int, peak_flops: float) -> dict:
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
    peak_mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    # A graph's activations live in its private pool, allocated once at capture: replays allocate nothing, so
    # the allocated peak misses them. The reserved peak counts the pool.
    reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else 0
    tokens_per_s = case.batch * case.seq_len / (step_ms * 1e-3)
    row = {"case": case.preset, "side": side, "batch": case.batch, "seq": case.seq_len, "step_ms": step_ms,
           "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * fpt / peak_flops, "peak_GiB": peak_mem / 2**30,
           "reserved_GiB": reserved / 2**30,
           "flops_per_token": fpt, "final_loss": records[-1]["loss"]}
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
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
                        help="the sides inside transformers.Trainer instead (bench/train_hf.py): ours, hf, hf+liger, hf+fm_attention")
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
        rows = [measure(side, table[name], device, steps=steps, warmup=warmup, peak_flops=peak) for side in sides]
        base = {r["side"]: r["tokens_per_s"] for r in rows}
        for row in rows:
            for column, side in (("x_vs_hf", "hf"), ("x_vs_hf_compile", "hf+compile")):
                if side in base:  # a ratio against a side that did not run is left blank, not NaN
                    row[column] = row["tokens_per_s"] / base[side]
            result.add(**row)
    print(result.markdown(COLUMNS))
    print(f"device: {result.env['device']}; matmul peak {peak / 1e12:.3g} TFLOP/s" + ("; DRY RUN: not a measurement" if args.dry_run else ""))
    result.write_json(args.out)
    return result


if __name__ == "__main__":
    main()
