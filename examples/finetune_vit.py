"""Fine-tune a ViT on an image folder (one subfolder per class) with timm transforms and Mixup/CutMix.

    python examples/finetune_vit.py --train data/images/train --eval data/images/val --num-labels 10
    python examples/finetune_vit.py --tiny --max-steps 2   # a tiny random ViT on generated 32-px images, CPU
"""

import argparse
import tempfile
from pathlib import Path

from flash_models.testing import write_color_image_folder
from flash_models.train import Trainer
from flash_models.train.preflight import experiment_or_usage_error

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "vit-finetune.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train"), parser.add_argument("--eval")
    parser.add_argument("--num-labels", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/finetune_vit")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if not args.tiny and not args.train:
        parser.error("give --train (and --eval) with your data, or --tiny for generated data")

    overrides = [f"train.output_dir={args.output_dir}"]
    if args.tiny:
        args.train = args.eval = str(write_color_image_folder(Path(tempfile.mkdtemp())))
        overrides += ["model.name=vit_tiny_patch16_224", "model.pretrained=false", "model.num_labels=2",
                      "model.overrides={img_size: 32, depth: 2}", "data.image_size=32", "train.global_batch_size=8",
                      "train.micro_batch_size=4", "train.precision=fp32", "train.device=cpu", "train.ema_decay=0.9",
                      "optim.warmup_steps=0"]
    if args.num_labels:
        overrides.append(f"model.num_labels={args.num_labels}")
    overrides += [f"data.train={args.train}", f"data.eval={args.eval}" if args.eval else "data.eval=null"]
    if args.max_steps is not None:  # 0 or less is named by the config's check
        overrides.append(f"train.max_steps={args.max_steps}")

    # The config keys this script sets from its options: a mistake is named by the option typed.
    flags = {"data.train": "--train", "data.eval": "--eval", "model.num_labels": "--num-labels",
             "train.max_steps": "--max-steps", "train.output_dir": "--output-dir"}
    trainer = Trainer(experiment_or_usage_error(parser, CONFIG, overrides, flags=flags))
    summary = trainer.fit()
    trainer.close()
    print(f"final loss {summary['final_loss']:.3f}, eval accuracy {summary.get('eval_accuracy', float('nan')):.2f}, "
          f"EMA accuracy {summary.get('eval_ema_accuracy', float('nan')):.2f}")


if __name__ == "__main__":
    main()
