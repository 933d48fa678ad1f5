"""How much host work one eager training step does per transformer layer, counted rather than timed: autograd
nodes by type, torch ops (the dispatcher's aten calls, forward and backward) by name, and Python function calls.
Each costs host time in every step, so a change that cuts them helps wherever the host bounds the step (small
models, eager loops); counts do not move with a busy machine as timings do, so two commits compare exactly.

A layer's share is the difference between the same model built with two layers and with one (the embedding,
the loss and the optimizer cancel out). Real widths, one row of 16 tokens, bf16 autocast, the README's loop
(forward with labels, backward). On CUDA every count is the step's own. On the CPU (the Triton kernels through
the interpreter) only the autograd nodes are: the interpreter's own torch ops and Python calls would swamp the
others, so they are not counted there.

    TRITON_INTERPRET=1 PYTHONPATH=.:kernels python scripts/profile/host_work.py [preset] [--backend triton]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

import flash_models as fm
from flash_models.backward import backward_on_this_thread


def _step(model, ids, device: str):
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    with backward_on_this_thread():
        loss.backward()
    model.zero_grad(set_to_none=True)
    return loss


def _graph_nodes(loss) -> collections.Counter:
    seen, count, stack = set(), collections.Counter(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count[type(node).__name__] += 1
        stack.extend(fn for fn, _ in node.next_functions)
    return count


def count(preset: str, layers: int, backend: str, device: str) -> dict[str, collections.Counter]:
    attn_impl = "flash" if backend == "triton" else "auto"
    model = fm.create_model(preset, num_hidden_layers=layers, kernel_backend=backend, attn_impl=attn_impl)
    model = model.to(device).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
    for _ in range(2):  # compile / autotune / fill the launch plans
        _step(model, ids, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        nodes = _graph_nodes(model(ids, labels=ids).loss)
    model.zero_grad(set_to_none=True)
    if device != "cuda":
        return {"autograd nodes": nodes}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, ids, device)
    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    calls = cProfile.Profile()
    calls.enable()
    _step(model, ids, device)
    calls.disable()
    return {"autograd nodes": nodes, "torch ops": ops,
            "python calls": collections.Counter(total=pstats.Stats(calls).total_calls)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", nargs="?", default="smollm2-135m")
    parser.add_argument("--backend", default="triton", help="the model's kernel_backend (triton, auto, reference)")
    parser.add_argument("--top", type=int, default=12, help="how many kinds of each to list")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    one, two = count(args.preset, 1, args.backend, device), count(args.preset, 2, args.backend, device)
    print(f"{args.preset}, kernel_backend={args.backend}, {device}: per layer of one training step")
    for what in one:
        per_layer = two[what] - one[what]  # (Counter subtraction keeps the positive differences)
        print(f"{sum(per_layer.values()):7d} {what}")
        if what != "python calls":
            for name, n in per_layer.most_common(args.top):
                print(f"{n:11d}  {name}")


if __name__ == "__main__":
    main()
