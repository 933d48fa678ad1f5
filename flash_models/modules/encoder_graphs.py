"""Encoder inference on padded batches replayed from CUDA graphs, one graph per shape bucket.

A BERT-base layer on a Hopper GPU takes less GPU time than the host needs to launch its kernels, so an eager
forward is host-bound (docs/benchmarks.md). A captured graph launches the whole encoder at once. Graphs need
fixed shapes and addresses, so each batch is placed in a bucket's static buffers and the graph does the rest
on the device: it packs the real tokens into one row (dropping the padding, so no layer spends work on it),
runs the encoder on them and scatters the outputs back to the padded layout. The host reads one thing per
batch, the rows' token counts, which pick the bucket; nothing is read back between that read and the replay,
so the GPU does not wait on host work in between (an earlier version packed on the host, two reads and a
dozen launches later, and lost 1.1 ms per BERT-base batch to the idle GPU).

A bucket holds:
- the padded input's rows and columns, each rounded up to a power of two (columns at least 16, at most the
  model's position limit); the extra rows and columns are padding;
- the packed tokens: a multiple of ``max_seqlen``, the extra tokens forming one padding sequence (id 0,
  position 0) that attends only to itself and is dropped from the output;
- the sequences: a power of two above the rows plus that padding sequence, the rest empty (repeated offsets;
  the varlen kernels allow zero-length sequences);
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


@dataclass(frozen=True)
class GraphKey:
    rows: int  # the padded batch's rows and columns as the graph's static buffers hold them
    columns: int
    bucket: Bucket


def bucket_for(lengths: list[int], *, seq_limit: int) -> Bucket:
    """The bucket that holds sequences of these lengths (host ints, as many as the batch has rows)."""
    longest = max(lengths, default=0)
    if longest > seq_limit:
        raise ValueError(f"a sequence of {longest} tokens exceeds the model's {seq_limit} positions")
    max_seqlen = min(max(next_power_of_2(longest), MIN_SEQLEN_BUCKET), seq_limit)
    total = sum(lengths)
    tokens = max(-(-total // max_seqlen), 1) * max_seqlen
    return Bucket(tokens=tokens, sequences=next_power_of_2(len(lengths) + 1), max_seqlen=max_seqlen)


def graph_key(lengths: list[int], columns: int, *, seq_limit: int) -> GraphKey:
    """The graph for a padded batch of ``len(lengths)`` rows of ``columns`` tokens, the rows holding
    ``lengths`` real tokens."""
    if columns > seq_limit:
        raise ValueError(f"a sequence of {columns} tokens exceeds the model's {seq_limit} positions")
    rows = next_power_of_2(len(lengths))
    padded_columns = min(max(next_power_of_2(columns), MIN_SEQLEN_BUCKET), seq_limit)
    return GraphKey(rows, padded_columns, bucket_for(lengths + [0] * (rows - len(lengths)), seq_limit=seq_limit))


def packed_layout(real: torch.Tensor, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """For a (rows, columns) bool mask of real tokens: (index, offsets). ``index`` (bucket.tokens,) holds the
    flat position of each packed token, row by row, then ``real.numel()`` (one past the end, a dummy slot) for
    the padding sequence; ``offsets`` (bucket.sequences + 1,) int32 are the packed sequences' bounds. Device
    work only, no host read, so a CUDA graph can capture it."""
    flat = real.reshape(-1)
    n = flat.numel()
    slot = torch.where(flat, flat.cumsum(0) - 1, bucket.tokens)  # the padding's slot, past the kept ones
    index = torch.full((bucket.tokens + 1,), n, dtype=torch.long, device=real.device)
    index.scatter_(0, slot, torch.arange(n, device=real.device))
    counts = real.sum(1, dtype=torch.int32)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32),
                         counts.new_full((bucket.sequences - real.shape[0],), bucket.tokens)])
    return index[:-1], offsets


@dataclass
class _Graph:
    # Static (rows, columns) inputs, overwritten before each replay: ids, positions, token types, real tokens.
    ids: torch.Tensor
    positions: torch.Tensor
    token_types: torch.Tensor
    real: torch.Tensor
    replay: Callable[[], None]
    out: torch.Tensor | None = None  # (rows, columns, hidden), zeros at the padding, written by each replay


class GraphedEncoder:
    """``encode(ids, positions, token_types, mask) -> hidden`` on packed rows, called here on a padded batch and
    run per bucket from a captured graph on CUDA. Off CUDA (tests) the same static buffers are run eagerly at
    each call."""

    def __init__(self, encode: Callable, module: torch.nn.Module, *, seq_limit: int, max_graphs: int = 16):
        self.encode, self.seq_limit, self.max_graphs = encode, seq_limit, max_graphs
        self.weights = WeightsWatch(module)  # graphs captured before the weights moved are dropped
        self.graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()
        self.pool = None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
        """ids/positions/token_types/attention_mask (B, S), the mask nonzero at real tokens (left or right
        padding). Returns (B, S, hidden) with zeros at the padding, a fresh tensor."""
        if self.weights.moved():
            self.graphs.clear()
            self.pool = None
        B, S = ids.shape
        key = graph_key(attention_mask.ne(0).sum(1).tolist(), S, seq_limit=self.seq_limit)  # the one host read
        # The static buffers and graph outputs are inference tensors, changed only in inference mode; the
        # result is cloned outside it, into an ordinary tensor the caller may change in place.
        with torch.inference_mode():
            graph = self.graphs.get(key)
            if graph is None:
                graph = self._build(key, (ids, positions, token_types, attention_mask))
            else:
                self._fill(graph, (ids, positions, token_types, attention_mask))
            self.graphs.move_to_end(key)
            graph.replay()
        return graph.out[:B, :S].clone()

    @staticmethod
    def _fill(graph: _Graph, inputs: tuple[torch.Tensor, ...]) -> None:
        B, S = inputs[0].shape
        graph.real.zero_()  # the bucket's extra rows and columns are padding
        for static, given in zip((graph.ids, graph.positions, graph.token_types, graph.real), inputs):
            static[:B, :S].copy_(given)

    def _build(self, key: GraphKey, inputs: tuple[torch.Tensor, ...]) -> _Graph:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        device, bucket = inputs[0].device, key.bucket
        zeros = lambda dtype: torch.zeros(key.rows, key.columns, dtype=dtype, device=device)  # noqa: E731
        graph = _Graph(ids=zeros(torch.long), positions=zeros(torch.long), token_types=zeros(torch.long),
                       real=zeros(torch.bool), replay=lambda: None)
        self._fill(graph, inputs)  # the warm-up and capture runs see this batch, which fits the bucket

        def run() -> torch.Tensor:
            index, offsets = packed_layout(graph.real, bucket)
            # The padding sequence gathers the dummy slot past the end: id 0, position 0, token type 0.
            take = lambda t: torch.cat([t.reshape(-1), t.new_zeros(1)])[index].unsqueeze(0)  # noqa: E731
            # A fresh mask each run: off CUDA the attention caches a dense mask built from the offsets' values.
            mask = AttentionMask(q_len=bucket.tokens, past_len=0, causal=False, sliding_window=None,
                                 key_padding=None, cu_seqlens=offsets, max_seqlen=bucket.max_seqlen)
            hidden = self.encode(take(graph.ids), take(graph.positions), take(graph.token_types), mask)[0]
            out = hidden.new_zeros(key.rows * key.columns + 1, hidden.shape[-1])
            out[index] = hidden  # the padding sequence lands in the dummy last row
            return out[:-1].view(key.rows, key.columns, -1)

        if device.type == "cuda":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph.out, graph.replay = capture(run, self.pool)
        else:
            graph.out = run()
            graph.replay = lambda: graph.out.copy_(run())
        self.graphs[key] = graph
        return graph
