"""The Hopper (Gluon) attention forward in eager models: its host cost against the Triton forward's, and what
``attention_hopper.EAGER_MIN_FLOP`` (small eager calls on the Triton forward) does to eager BERT and ViT steps.

Three dispatch modes, each the whole process's setting while it is timed:
- "rule": the library's default (small eager calls on the Triton forward once the Gluon kernel is loaded);
- "gluon": every call the Gluon kernel can run takes it (``EAGER_MIN_FLOP`` = 0; the code before session 29);
- "triton": the Gluon kernel off (``use_hopper_forward(False)``).

1. Attention alone at BERT-base's (128 x 128 tokens) and ViT-B's (128 x 197) shapes, 12 heads of 64: host us a
   call (a Python loop of calls, ``host_cost.host_us``) and the back-to-back time a call.
2. Eager bert-base inference (128 tokens, batch 128, no padding) and eager ViT-B/16 training (batch 128),
   the modes alternated over ``ROUNDS`` rounds (a noisy host moves whole rounds): the median of each mode.

    PYTHONPATH=.:kernels python scripts/profile/eager_hopper_forward.py   # on a Hopper GPU
"""

import statistics
import sys
from pathlib import Path

import torch

from flash_kernels import attention_hopper, flash_attn_func
from flash_models.bench.bert import _step_fns as bert_steps, build_pair, make_batch
from flash_models.bench.harness import time_cuda
from flash_models.bench.vit import _step_fns as vit_steps, build_models

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import host_us  # noqa: E402

ROUNDS = 6
RULE = attention_hopper.EAGER_MIN_FLOP


def set_mode(mode: str) -> None:
    attention_hopper.use_hopper_forward(mode != "triton")
    attention_hopper.EAGER_MIN_FLOP = 0 if mode == "gluon" else RULE


def attention_alone() -> None:
    shapes = {"bert-base 128 x 128": 128, "vit-b 128 x 197": 197}
    for name, seq in shapes.items():
        q, k, v = (torch.randn(128, seq, 12, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        call = lambda: flash_attn_func(q, k, v)  # noqa: E731
        for mode in ("rule", "gluon", "triton"):
            set_mode(mode)
            queued = time_cuda(call, warmup=5, repeats=50, back_to_back=True).median_ms * 1e3
            print(f"{name} {mode}: host {host_us(call, 200):.1f} us a call, back to back {queued:.1f} us")


def model_steps() -> None:
    device = torch.device("cuda")
    hf, bert = build_pair("bert-base", dtype=torch.bfloat16, device=device, dry_run=False)
    ids, mask = make_batch(128, 128, 0.0, hf.config.vocab_size, "cuda")
    bert.eval()
    bert_inference, _ = bert_steps(bert, ids, mask, is_hf=False)
    vit = build_models("vit-b16", dtype=torch.bfloat16, device=device, dry_run=False, compile_peer=False)["ours"]
    images = torch.randn(128, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (128,), device="cuda")
    _, vit_training = vit_steps(vit.train(), images, labels, impl="ours")
    modes = ("rule", "gluon", "triton")
    for label, step in (("bert-base inference 128", bert_inference), ("vit-b16 training", vit_training)):
        times = {mode: [] for mode in modes}
        for r in range(ROUNDS):
            for mode in modes[r % 3:] + modes[:r % 3]:
                set_mode(mode)
                times[mode].append(time_cuda(step, warmup=3, repeats=10).median_ms)
        print(label + ": " + ", ".join(f"{mode} {statistics.median(ts):.2f} ms {[round(t, 2) for t in ts]}"
                                       for mode, ts in times.items()))


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    attention_alone()
    model_steps()
    set_mode("rule")
