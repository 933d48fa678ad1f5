"""Pretrain GPT-2 on your own text with the configs/gpt2-small.yaml recipe.

    python examples/train_gpt2.py --data "data/owt/*.txt" --tokenizer data/gpt2-tokenizer
    torchrun --standalone --nproc-per-node 8 examples/train_gpt2.py --data ... --strategy ddp
    python examples/train_gpt2.py --tiny --max-steps 5      # a 2-layer model on a generated corpus, on the CPU
"""

import argparse
import random
import tempfile
from pathlib import Path

from flash_models.train import Trainer
from flash_models.train.preflight import experiment_or_usage_error

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpt2-small.yaml"


def tiny_corpus(directory: Path) -> Path:
    rng = random.Random(0)
    words = "the a model trains on text and learns to predict the next token quickly".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(300)]
    path = directory / "corpus.txt"
    path.write_text("\n\n".join(docs))  # text format: documents are separated by blank lines
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="text files: a file, a folder or a glob")
    parser.add_argument("--tokenizer", help="an HF tokenizer folder (or 'bytes')")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--strategy", default="none", choices=["none", "ddp", "fsdp", "tp"])
    parser.add_argument("--output-dir", default="runs/train_gpt2")
    parser.add_argument("--tiny", action="store_true", help="tiny model and generated data (CI smoke test)")
    args = parser.parse_args()

    overrides = [f"distributed.strategy={args.strategy}", f"train.output_dir={args.output_dir}", "train.resume=auto"]
    if args.tiny:
        data = tiny_corpus(Path(tempfile.mkdtemp()))
        overrides += [
            "model.overrides={n_layer: 2, n_embd: 64, n_head: 4, n_positions: 128, vocab_size: 257, bos_token_id: 256, eos_token_id: 256}",
            "data.format=text", f"data.train={data}", f"data.eval={data}", "data.tokenizer=bytes", "data.seq_len=64",
            f"data.cache_dir={data.parent / 'cache'}", "train.global_batch_size=8", "train.micro_batch_size=4",
            "train.precision=fp32", "train.compile=false", "train.device=cpu", "train.eval_batches=2", "optim.warmup_steps=2",
            "optim.lr=3e-3", "train.save_every=0",
        ]
    elif args.data:
        overrides += ["data.format=text", f"data.train={args.data}", "data.eval=null"]
    if args.tokenizer:
        overrides.append(f"data.tokenizer={args.tokenizer}")
    if args.max_steps is not None:  # 0 or less is named by the config's check
        overrides.append(f"train.max_steps={args.max_steps}")

    # The config keys this script sets from its options: a mistake is named by the option typed.
    flags = {"data.train": "--data", "data.tokenizer": "--tokenizer", "train.max_steps": "--max-steps",
             "distributed.strategy": "--strategy", "train.output_dir": "--output-dir"}
    trainer = Trainer(experiment_or_usage_error(parser, CONFIG, overrides, flags=flags))
    summary = trainer.fit()
    trainer.close()
    if trainer.dist.is_main:  # under torchrun every rank gets here; one reports
        print(f"final loss {summary['final_loss']:.3f}, eval perplexity {summary.get('eval_perplexity', float('nan')):.1f}, "
              f"{summary['tokens_per_s']:.0f} tokens/s, MFU {summary['mfu']:.1%}; model in {summary['exported']}")


if __name__ == "__main__":
    main()
