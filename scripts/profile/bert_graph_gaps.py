"""Where the wall time of a graphed BERT inference call goes (``BertModel.use_cuda_graphs``, as bench bert
times it: CUDA events around each call, synced): the host's work before the replay (the GPU idles through it:
the call reads the row lengths, which waits for the GPU), the replay's GPU time, and what follows it. Then a
cProfile of the call's host side.

    PYTHONPATH=.:kernels python scripts/profile/bert_graph_gaps.py [bert-base] [seq] [padding]   # on a CUDA GPU
"""

import statistics
import sys
import time

import torch

from flash_models.bench.bert import build_pair, make_batch
from host_cost import cprofile_stats  # this folder's sibling module


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "bert-base"
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    padding = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    hf, ours = build_pair(name, dtype=torch.bfloat16, device=torch.device("cuda"), dry_run=False)
    del hf
    ids, mask = make_batch(16384 // seq, seq, padding, ours.config.vocab_size, "cuda")
    ours.eval().use_cuda_graphs(True)

    def call():
        with torch.inference_mode():
            return ours(ids, attention_mask=mask).last_hidden_state

    for _ in range(3):
        call()
    graph = next(iter(ours.graphed.graphs.values()))
    marks = {}
    replay = graph.replay

    def marked_replay():
        marks["replay"] = time.perf_counter()
        replay()
        marks["replayed"] = time.perf_counter()

    graph.replay = marked_replay
    walls, pre, post = [], [], []
    for _ in range(20):
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        start_event.record()
        call()
        end_event.record()
        returned = time.perf_counter()
        end_event.synchronize()
        walls.append(start_event.elapsed_time(end_event) * 1e3)
        pre.append((marks["replay"] - start) * 1e6)
        post.append((returned - marks["replayed"]) * 1e6)
    graph.replay = replay
    times = []  # the replay alone (a graph cannot be captured into another: events around each)
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    replay_us = statistics.median(times)
    print(f"{torch.cuda.get_device_name()}: {name} seq {seq} padding {padding:.0%} inference, graphed, us (median of 20)")
    print(f"wall per call {statistics.median(walls):.0f}; replay alone {replay_us:.0f}; host before the replay "
          f"{statistics.median(pre):.0f}; host after it {statistics.median(post):.0f}")
    torch.cuda.synchronize()
    print(cprofile_stats(call, 20, sorts=("tottime", "cumulative"), rows=30))


if __name__ == "__main__":
    main()
