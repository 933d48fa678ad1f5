"""Packed encoder inference replayed from CUDA graphs, one graph per shape bucket.

A BERT-base layer on a Hopper GPU takes less GPU time than the host needs to launch its kernels, so an eager
forward is host-bound (docs/benchmarks.md). A captured graph launches the whole encoder at once. Graphs need
fixed shapes and addresses, and a packed batch changes both, so each batch is padded up to a bucket:

- tokens: a multiple of the bucket's ``max_seqlen``, the extra tokens forming one padding sequence (id 0,
  positions from 0) that attends only to itself and is dropped from the output;
- sequences: a power of two above the real count plus that padding sequence, the rest empty (repeated
  offsets; the varlen kernels allow zero-length sequences);
- ``max_seqlen``: the next power of two at or above the longest sequence (at least 16), at most the model's
  position limit. The attention grid is sized by it, so it is part of the bucket.

Every row of an encoder layer depends only on its own sequence, so the real tokens' outputs are those of the
unpadded batch. Graphs share one memory pool and are kept for the ``max_graphs`` most recent buckets.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from flash_kernels._triton_utils import next_power_of_2

from .attention import AttentionMask
from .cuda_graphs import WeightsWatch, capture

MIN_SEQLEN_BUCKET = 16


@dataclass(frozen=True)
class Bucket:
    tokens: int
    sequences: int  # offsets hold sequences + 1 entries
    max_seqlen: int


def bucket_for(lengths: list[int], *, seq_limit: int) -> Bucket:
    """The bucket that holds sequences of these lengths (host ints, as many as the batch has rows)."""
    longest = max(lengths, default=0)
    if longest > seq_limit:
        raise ValueError(f"a sequence of {longest} tokens exceeds the model's {seq_limit} positions")
    max_seqlen = min(max(next_power_of_2(longest), MIN_SEQLEN_BUCKET), seq_limit)
    total = sum(lengths)
    tokens = max(-(-total // max_seqlen), 1) * max_seqlen
    return Bucket(tokens=tokens, sequences=next_power_of_2(len(lengths) + 1), max_seqlen=max_seqlen)


def padded_offsets(lengths: list[int], bucket: Bucket) -> list[int]:
    """Offsets of the real sequences, then the padding sequence, then empty ones: ``bucket.sequences + 1``."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    offsets.append(bucket.tokens)  # the padding sequence (possibly empty)
    offsets += [bucket.tokens] * (bucket.sequences + 1 - len(offsets))
    return offsets


@dataclass
class _Graph:
    ids: torch.Tensor  # (1, tokens) static inputs, overwritten before each replay
    positions: torch.Tensor
    token_types: torch.Tensor
    offsets: torch.Tensor  # (sequences + 1,) int32
    replay: Callable[[], None]
    out: torch.Tensor | None = None  # (1, tokens, hidden), written by each replay


class GraphedEncoder:
    """``encode(ids, positions, token_types, mask) -> hidden (1, tokens, hidden)`` for packed rows, run per bucket
    from a captured graph on CUDA. Off CUDA (tests) the same static buffers are run eagerly at each call."""

    def __init__(self, encode: Callable, module: torch.nn.Module, *, seq_limit: int, max_graphs: int = 16):
        self.encode, self.seq_limit, self.max_graphs = encode, seq_limit, max_graphs
        self.weights = WeightsWatch(module)  # graphs captured before the weights moved are dropped
        self.graphs: OrderedDict[Bucket, _Graph] = OrderedDict()
        self.pool = None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                 lengths: list[int]) -> torch.Tensor:
        """ids/positions/token_types (total,) packed real tokens; lengths the rows' token counts (host ints).
        Returns (1, total, hidden), a fresh tensor."""
        if self.weights.moved():
            self.graphs.clear()
            self.pool = None
        bucket = bucket_for(lengths, seq_limit=self.seq_limit)
        total = ids.numel()
        # The static buffers and graph outputs are inference tensors, changed only in inference mode; the
        # result is cloned outside it, into an ordinary tensor the caller may change in place.
        with torch.inference_mode():
            graph = self.graphs.get(bucket) or self._build(bucket, ids.device)
            self.graphs.move_to_end(bucket)
            pad = bucket.tokens - total
            graph.ids[0, :total].copy_(ids)
            graph.ids[0, total:].zero_()
            graph.positions[0, :total].copy_(positions)
            graph.positions[0, total:].copy_(torch.arange(pad, device=ids.device))
            graph.token_types[0, :total].copy_(token_types)
            graph.token_types[0, total:].zero_()
            graph.offsets.copy_(torch.tensor(padded_offsets(lengths, bucket), dtype=torch.int32))
            graph.replay()
        return graph.out[:, :total].clone()

    def _build(self, bucket: Bucket, device: torch.device) -> _Graph:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        zeros = lambda dtype: torch.zeros(1, bucket.tokens, dtype=dtype, device=device)  # noqa: E731
        # The warm-up and capture runs see zero tokens cut into max_seqlen-sized sequences.
        offsets = [min(i * bucket.max_seqlen, bucket.tokens) for i in range(bucket.sequences + 1)]
        graph = _Graph(ids=zeros(torch.long), positions=zeros(torch.long), token_types=zeros(torch.long),
                       offsets=torch.tensor(offsets, dtype=torch.int32, device=device), replay=lambda: None)

        def run() -> torch.Tensor:
            # A fresh mask each run: off CUDA the attention caches a dense mask built from the offsets' values.
            mask = AttentionMask(q_len=bucket.tokens, past_len=0, causal=False, sliding_window=None,
                                 key_padding=None, cu_seqlens=graph.offsets, max_seqlen=bucket.max_seqlen)
            return self.encode(graph.ids, graph.positions, graph.token_types, mask)

        if device.type == "cuda":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph.out, graph.replay = capture(run, self.pool)
        else:
            graph.out = run()
            graph.replay = lambda: graph.out.copy_(run())
        self.graphs[bucket] = graph
        return graph
