"""Kernel time of one BERT step, ours (eager and graphed) vs HF sdpa, per kernel name: where `bench bert` loses
or wins at a given padding.

    PYTHONPATH=.:kernels python scripts/profile/bert_kernels.py [bert-base] [inference|training] [seq] [padding]

On a CUDA GPU. Prints, per side, the wall time of a step, the GPU kernel time inside it (their gap is host
overhead) and the 25 most expensive kernels per step.
"""

import sys

import torch

from flash_models.bench.bert import graphed_training, step_fns, build_pair, make_batch
from kernel_table import print_step, time_and_profile  # this folder's sibling module


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "bert-base"
    mode = sys.argv[2] if len(sys.argv) > 2 else "inference"
    seq = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    padding = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    device = torch.device("cuda")
    hf, ours = build_pair(name, dtype=torch.bfloat16, device=device, dry_run=False)
    ids, mask = make_batch(16384 // seq, seq, padding, hf.config.vocab_size, device)
    title = f"{name} {mode} seq {seq} padding {padding:.0%}"
    for impl, model in (("HF sdpa", hf), ("ours", ours), ("ours+graphs", ours)):
        model.train(mode == "training")
        # As bench bert runs them: inference through BertModel.use_cuda_graphs, training packed and graphed.
        model_graphs = impl == "ours+graphs" and mode == "inference"
        if model_graphs:
            model.use_cuda_graphs(True)
        inference, training = step_fns(model, ids, mask, is_hf=model is hf)
        if impl == "ours+graphs" and mode == "training":
            training = graphed_training(model, ids, mask, seq)
        print_step(f"{title}, {impl}", *time_and_profile(training if mode == "training" else inference))
        if model_graphs:
            model.use_cuda_graphs(False)


if __name__ == "__main__":
    main()
