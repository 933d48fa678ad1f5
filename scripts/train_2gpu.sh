#!/usr/bin/env bash
# The 2-GPU NCCL check (two GPUs of one host): GPT-2 124M on synthetic tokens for 50 steps with DDP (+ the bf16
# compression hook), FSDP2 and tensor parallelism, then one GPU alone for the single-process reference. Each run
# prints its summary (tokens/s, MFU, peak memory) as JSON and writes runs/2gpu-*/metrics.jsonl (per-step losses).
# Usage: bash scripts/train_2gpu.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
common=(configs/gpt2-small.yaml data.format=synthetic data.synthetic_tokens=20000000 data.eval=null
        data.train=null train.max_steps=50 train.global_batch_size=32 train.micro_batch_size=16
        train.eval_every=0 train.save_every=0 train.export=false train.resume=null train.log_every=1
        optim.warmup_steps=5 "$@")
CUDA_VISIBLE_DEVICES=0 python -m flash_models train "${common[@]}" train.output_dir=runs/2gpu-single
for strategy in ddp fsdp tp; do
    extra=()
    [ "$strategy" = ddp ] && extra=(distributed.ddp_bf16_compress=true)
    [ "$strategy" = tp ] && extra=(train.micro_batch_size=32)  # TP ranks share the batch: same global batch per step
    torchrun --standalone --nproc-per-node 2 -m flash_models train "${common[@]}" distributed.strategy=$strategy \
        train.output_dir=runs/2gpu-$strategy "${extra[@]}"
done
python - <<'PY'
import json
runs = {name: [json.loads(l) for l in open(f"runs/2gpu-{name}/metrics.jsonl")] for name in ("single", "ddp", "fsdp", "tp")}
losses = {name: [l["loss"] for l in lines if "loss" in l and not l.get("summary")] for name, lines in runs.items()}
print("| run | loss step 1 | loss step 50 | max rel. diff vs single | tokens/s | MFU | peak GiB |")
print("|---|---|---|---|---|---|---|")
for name, lines in runs.items():
    summary = lines[-1]
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["single"]))
    print(f"| {name} | {losses[name][0]:.4f} | {losses[name][-1]:.4f} | {diff:.2e} | {summary['tokens_per_s']:.0f} "
          f"| {summary['mfu']:.3f} | {summary['peak_memory_bytes'] / 2**30:.2f} |")
PY
