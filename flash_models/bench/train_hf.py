"""`flash-models bench train --hf-trainer`: training throughput inside transformers.Trainer, ours vs HF's.

Every side is one ``transformers.Trainer`` run with the same ``TrainingArguments`` (bf16 autocast, fused AdamW,
the same batch of synthetic tokens, no evaluation, logging or saving inside the timed steps) and differs only
in the model:

- ``ours``: our model (``create_model``) as the Trainer's model;
- ``hf``: HF's model with sdpa attention;
- ``hf+liger``: HF's model with ``use_liger_kernel=True`` (skipped, and said so, where liger-kernel is not
  installed or has no kernels for the model type: GPT-2);
- ``hf+fm_attention``: HF's model with our attention (``flash_models.hf.register()``, ``attn_implementation=
  "fm_attention"``);
- ``hf+fm_attention+fused_ops``: the same with ``flash_models.hf.use_fused_ops`` too (our fused norms and
  cross-entropy), everything of ours that plugs into HF's model.

Cases: GPT-2 124M (vocabulary 50257, as the checkpoint has it) at 16x1024 and LLaMA-1.1B at 4x2048. A step is
timed on the GPU from the end of one optimizer step to the end of the next (a callback records a CUDA event
there, and nothing waits for it until the run ends: the Trainer's own host reads are its only syncs); the
mean over the timed steps is reported, with tokens/s, MFU (6N + 12*L*D*S FLOPs per token against a measured
bf16 matmul peak) and peak memory.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import statistics
import tempfile
import time

import torch
import transformers

from ..checkpoint.loader import create_model
from ..registry import get_preset
from ..train.metrics import flops_per_token, measure_matmul_peak
from .harness import BenchResult

log = logging.getLogger(__name__)

HF_SIDES = ("ours", "hf", "hf+liger", "hf+fm_attention", "hf+fm_attention+fused_ops")
COLUMNS = ["case", "side", "batch", "seq", "step_ms", "tokens_per_s", "mfu", "peak_GiB", "x_vs_hf", "x_vs_hf_liger"]


class _StepTimer(transformers.TrainerCallback):
    """The end of every optimizer step, as a CUDA event on the GPU's stream (a wall clock on the CPU): nothing
    here waits for the GPU, so the Trainer's host work overlaps the GPU's as it does in a user's run. The peak
    memory counts from the first timed step on."""

    def __init__(self, warmup: int):
        self.warmup, self.ends = warmup, []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.ends.append(end)
        else:
            self.ends.append(time.perf_counter())
        if len(self.ends) == self.warmup and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def intervals_ms(self) -> list[float]:
        """Each timed step's time, from the end of the step before it."""
        ends = self.ends[self.warmup - 1:]
        if ends and isinstance(ends[0], torch.cuda.Event):
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(ends, ends[1:])]
        return [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]


class _Tokens(torch.utils.data.Dataset):
    """Random token rows (labels = inputs), the same for every side."""

    def __init__(self, rows: int, seq_len: int, vocab: int):
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _liger_missing(case) -> str | None:
    """Why the hf+liger side cannot measure Liger on this case, or None. Liger leaves a model type it has no
    kernels for untouched (GPT-2's), and that row would be HF's model under another name."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel not installed (pip install liger-kernel)"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = get_preset(case.preset).model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger-kernel has no kernels for model_type {model_type!r}"
    return None


def build(side: str, case, overrides: dict) -> torch.nn.Module:
    if side == "ours":
        return create_model(case.preset, **overrides)
    spec = get_preset(case.preset)
    hf_config = transformers.AutoConfig.for_model(spec.model_type, **{**spec.hf_config, **overrides})
    attention = "sdpa"
    if side.startswith("hf+fm_attention"):
        from ..hf import register

        attention = register()
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention)
    if side == "hf+fm_attention+fused_ops":
        from ..hf import use_fused_ops

        use_fused_ops(model)
    return model


def measure(side: str, case, overrides: dict, device: torch.device, *, steps: int, warmup: int, peak_flops: float,
            callbacks: tuple = ()) -> dict:
    """One side's row; ``callbacks`` join the Trainer's (the profiler's, in scripts/profile/trainer_steps.py)."""
    model = build(side, case, overrides)
    fpt = flops_per_token(model, case.seq_len)
    timer = _StepTimer(warmup)
    with tempfile.TemporaryDirectory(prefix="flash-models-bench-train-hf-") as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=case.batch, max_steps=warmup + steps, learning_rate=1e-4,
            lr_scheduler_type="constant", bf16=device.type == "cuda", optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
            use_liger_kernel=side == "hf+liger", logging_strategy="no", save_strategy="no", report_to=[],
            use_cpu=device.type == "cpu", dataloader_pin_memory=device.type == "cuda", disable_tqdm=True, seed=0,
        )
        data = _Tokens(case.batch * (warmup + steps), case.seq_len, model.config.vocab_size)
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[timer, *callbacks]).train()
    step_ms = statistics.fmean(timer.intervals_ms())
    tokens_per_s = case.batch * case.seq_len / (step_ms * 1e-3)
    row = {"case": case.preset, "side": side, "batch": case.batch, "seq": case.seq_len, "step_ms": step_ms,
           "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * fpt / peak_flops,
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
           "flops_per_token": fpt}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args, *, cases: dict, dry_cases: dict, no_dropout) -> BenchResult:
    """``bench train --hf-trainer``: the parsed arguments of ``bench train`` (cases, sides, steps, warmup, out,
    dry_run); the case tables and the dropout switch are bench/train.py's."""
    if args.dry_run:
        device, table = torch.device("cpu"), dry_cases
        steps, warmup = min(args.steps, 2), min(args.warmup, 1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench train measures GPU throughput; without CUDA use --dry-run")
        device, steps, warmup = torch.device("cuda"), args.steps, args.warmup
        # The checkpoints' vocabularies: GPT-2's 50257, not a padded one.
        table = {name: case for name, case in cases.items() if name in ("gpt2", "llama-1b")}
    sides = HF_SIDES if args.sides is None else tuple(args.sides.split(","))
    names = args.cases.split(",") if args.cases else list(table)
    unknown = [n for n in names if n not in table] + [s for s in sides if s not in HF_SIDES]
    if unknown:
        raise SystemExit(f"unknown cases/sides {unknown}; cases: {list(table)}, sides: {list(HF_SIDES)}")
    if warmup < 1:
        raise SystemExit("--warmup must be >= 1: the first step's end starts the clock")
    peak = measure_matmul_peak(device)
    result = BenchResult(area="train-hf-trainer")
    result.env.update(matmul_peak_tflops=peak / 1e12, dry_run=args.dry_run, skipped=[])
    for name in names:
        case = table[name]
        overrides = {**no_dropout(case.preset), **(dict(case.overrides) if args.dry_run else {})}
        rows = []
        for side in sides:
            if side == "hf+liger" and (reason := _liger_missing(case)):
                log.warning("side hf+liger skipped for %s: %s", name, reason)
                result.env["skipped"].append(f"{name}/hf+liger: {reason}")
                continue
            rows.append(measure(side, case, overrides, device, steps=steps, warmup=warmup, peak_flops=peak))
        base = {r["side"]: r["tokens_per_s"] for r in rows}
        for row in rows:
            for column, side in (("x_vs_hf", "hf"), ("x_vs_hf_liger", "hf+liger")):
                if side in base:
                    row[column] = row["tokens_per_s"] / base[side]
            result.add(**row)
    print(result.markdown(COLUMNS))
    print(f"device: {result.env['device']}; matmul peak {peak / 1e12:.3g} TFLOP/s"
          + "".join(f"; skipped {s}" for s in result.env["skipped"]) + ("; DRY RUN: not a measurement" if args.dry_run else ""))
    result.write_json(args.out)
    return result
