"""Encoder inference on padded batches replayed from CUDA graphs, one graph per shape bucket.

A BERT-base layer on a Hopper GPU takes less GPU time than the host needs to launch its kernels, so an eager
forward is host-bound (`scripts/profile/bert_kernels.py` prints a step's wall time against its kernel time). A
captured graph launches the whole encoder at once. Graphs need
fixed shapes and addresses, so each batch is placed in a bucket's static buffers and the graph does the rest
on the device: it packs the real tokens into one row (dropping the padding, so no layer spends work on it),
runs the encoder on them and leaves each padded position's row for the call's one gather back to the padded
layout. The host reads one thing per batch, the rows' token counts, which pick the bucket; the GPU then idles
until the replay starts, so the host does as little as it can in between: it copies the inputs in and replays,
and the input checks run inside the graph (packing on the host would add two reads and a dozen launches, with
the GPU idle through them).

A bucket holds:
- the padded input's rows and columns, each rounded up to a power of two (columns at least 16, at most the
  model's position limit); the extra rows and columns are padding;
- the packed tokens: a multiple of ``max_seqlen``, the extra tokens forming one padding sequence (id 0,
  position 0) that attends only to itself and is dropped from the output;
- the sequences: one per row, then that padding sequence (empty where the rows fill the bucket: repeated
  offsets, which the varlen kernels allow). No more: the Hopper forward's persistent programs walk every
  sequence, so each extra (empty) sequence costs every attention call time;
- ``max_seqlen``: the next power of two at or above the longest sequence (at least 16), at most the model's
  position limit. The attention grid is sized by it, so it is part of the bucket.

Every row of an encoder layer depends only on its own sequence, so the real tokens' outputs are those of the
unpadded batch. Graphs share one memory pool and are kept for the ``max_graphs`` most recent buckets.

Batches without padding (a lone tokenized sentence, fixed-length inputs) skip the wait for the read. Once a
batch of some (B, S) had no padding, the next one of that (B, S) replays the same graph at once with every
position taken as real, and its token count is read after the replay is launched, from a copy queued before
it: the GPU does not idle through the host's read. If that batch did have padding, the run is void (its padding
was encoded as tokens): the batch takes the read-first path, its (B, S) with it from then on, and one forward's work is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from flash_kernels._triton_utils import next_power_of_2

from ..modules.attention import AttentionMask
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
    positions_given: bool = False  # else each token's column, made inside the graph (BERT's default)
    token_types_given: bool = False  # else zeros, made inside the graph
    # The call's batch has padding, so the output gets a row of zeros for it to gather. Without padding that
    # row's copy of the whole output (22 us a BERT-large forward at 16k tokens on an H100) is left out.
    has_padding: bool = True


def bucket_for(lengths: list[int], *, seq_limit: int) -> Bucket:
    """The bucket that holds sequences of these lengths (host ints, as many as the batch has rows)."""
    longest = max(lengths, default=0)
    if longest > seq_limit:
        raise ValueError(f"a sequence of {longest} tokens exceeds the model's {seq_limit} positions")
    max_seqlen = min(max(next_power_of_2(longest), MIN_SEQLEN_BUCKET), seq_limit)
    total = sum(lengths)
    tokens = max(-(-total // max_seqlen), 1) * max_seqlen
    return Bucket(tokens=tokens, sequences=len(lengths) + 1, max_seqlen=max_seqlen)


def graph_key(lengths: list[int], columns: int, *, seq_limit: int, positions_given: bool = False,
              token_types_given: bool = False) -> GraphKey:
    """The graph for a padded batch of ``len(lengths)`` rows of ``columns`` tokens, the rows holding
    ``lengths`` real tokens."""
    if columns > seq_limit:
        raise ValueError(f"a sequence of {columns} tokens exceeds the model's {seq_limit} positions")
    rows = next_power_of_2(len(lengths))
    padded_columns = min(max(next_power_of_2(columns), MIN_SEQLEN_BUCKET), seq_limit)
    return GraphKey(rows, padded_columns, bucket_for(lengths + [0] * (rows - len(lengths)), seq_limit=seq_limit),
                    positions_given, token_types_given, has_padding=sum(lengths) < len(lengths) * columns)


def packed_layout(real: torch.Tensor, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a (rows, columns) bool mask of real tokens: (index, offsets, slot). ``index`` (bucket.tokens,) holds
    the flat position of each packed token, row by row, then ``real.numel()`` (one past the end, a dummy slot)
    for the padding sequence; ``offsets`` (bucket.sequences + 1,) int32 are the packed sequences' bounds;
    ``slot`` (rows, columns) is the inverse of ``index``: each real token's packed row, ``bucket.tokens`` at the
    padding. Device work only, no host read, so a CUDA graph can capture it."""
    flat = real.reshape(-1)
    n = flat.numel()
    slot = torch.where(flat, flat.cumsum(0) - 1, bucket.tokens)  # the padding's slot, past the kept ones
    index = torch.full((bucket.tokens + 1,), n, dtype=torch.long, device=real.device)
    index.scatter_(0, slot, torch.arange(n, device=real.device))
    counts = real.sum(1, dtype=torch.int32)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32),
                         counts.new_full((bucket.sequences - real.shape[0],), bucket.tokens)])
    return index[:-1], offsets, slot.view(real.shape)


@dataclass
class _Graph:
    # Static (rows, columns) inputs, overwritten before each call's replay: ids, real tokens, and positions and
    # token types where the caller gives them.
    ids: torch.Tensor
    real: torch.Tensor
    positions: torch.Tensor | None
    token_types: torch.Tensor | None
    replay: Callable[[], None]
    # Written by each replay: the encoder's (tokens, hidden) output, followed by a row of zeros where the batch
    # has padding, and each padded position's row in it (the zero row at the padding). The call gathers its
    # (B, S, hidden) result from them.
    packed: torch.Tensor | None = None
    slot: torch.Tensor | None = None


class _AsyncCount:
    """A mask's count of nonzeros, copied to the host behind the work queued after it: on CUDA into pinned
    memory, ``read`` waiting only for the count and its copy, not for what was launched in between."""

    def __init__(self):
        self.host = self.done = self.count = None

    def start(self, mask: torch.Tensor) -> None:
        self.count = torch.count_nonzero(mask)
        if mask.is_cuda:
            if self.host is None:
                self.host, self.done = torch.empty((), dtype=torch.long, pin_memory=True), torch.cuda.Event()
            self.host.copy_(self.count, non_blocking=True)  # queued on the mask's device's current stream
            self.done.record(torch.cuda.current_stream(mask.device))

    def read(self) -> int:
        if not self.count.is_cuda:
            return int(self.count)
        self.done.synchronize()
        return int(self.host)


class GraphedEncoder:
    """``encode(ids, positions, token_types, mask) -> hidden`` on packed rows, called here on a padded batch and
    run per bucket from a captured graph on CUDA. Off CUDA (tests) the same static buffers are run eagerly at
    each call.

    ``check(ids, positions, token_types)`` (positions and token_types may be None) validates the inputs inside
    the graph, on its static buffers, so each replay checks its own batch; the host then launches only the
    copies that fill the buffers, the replay and the final gather, and the GPU idles less between the host's
    read of the row lengths and the replay."""

    def __init__(self, encode: Callable, module: torch.nn.Module, *, seq_limit: int, check: Callable | None = None,
                 max_graphs: int = 16):
        self.encode, self.check, self.seq_limit, self.max_graphs = encode, check, seq_limit, max_graphs
        self.weights = WeightsWatch(module)  # graphs captured before the weights moved are dropped
        self.graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()
        # (B, S, positions given, token types given) -> the graph of its last batch, which had no padding.
        self.unpadded: dict[tuple, GraphKey] = {}
        self.pool = None
        self._count = _AsyncCount()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor | None, token_types: torch.Tensor | None,
                 attention_mask: torch.Tensor) -> torch.Tensor:
        """ids/attention_mask (B, S), the mask nonzero at real tokens (left or right padding); positions and
        token_types (B, S) or None (each token's column; zeros). Returns (B, S, hidden) with zeros at the
        padding, a fresh tensor."""
        if self.weights.moved():
            self.graphs.clear()
            self.unpadded.clear()
            self.pool, self._count = None, _AsyncCount()  # the weights, and so the graphs, may be on another GPU
        B, S = ids.shape
        shape = (B, S, positions is not None, token_types is not None)
        inputs = (ids, positions, token_types, attention_mask)
        # The static buffers and graph outputs are inference tensors, changed only in inference mode; the
        # result is gathered outside it, into an ordinary tensor the caller may change in place.
        with torch.inference_mode():
            key = self.unpadded.get(shape)
            graph = self.graphs.get(key) if key is not None else None
            if graph is not None and not self._replay_as_unpadded(graph, inputs):
                graph = None  # it had padding after all: that run is void
            if graph is None:
                lengths = torch.count_nonzero(attention_mask, dim=1).tolist()  # the one host read
                key = graph_key(lengths, S, seq_limit=self.seq_limit, positions_given=shape[2],
                                token_types_given=shape[3])
                graph = self.graphs.get(key)
                if graph is None:
                    graph = self._build(key, inputs)
                else:
                    self._fill(graph, inputs)
                graph.replay()
                if key.has_padding:
                    self.unpadded.pop(shape, None)
                else:
                    self.unpadded[shape] = key
            self.graphs.move_to_end(key)
        return F.embedding(graph.slot[:B, :S], graph.packed)

    def _replay_as_unpadded(self, graph: _Graph, inputs: tuple[torch.Tensor | None, ...]) -> bool:
        """Replays an unpadded batch's graph on ``inputs`` with every position taken as real (so the layout is
        that graph's own), then reads the mask's count: whether the batch indeed had no padding."""
        ids, positions, token_types, mask = inputs
        B, S = ids.shape
        self._count.start(mask)
        self._fill(graph, (ids, positions, token_types, None))
        graph.real[:B, :S] = True
        graph.replay()
        return self._count.read() == B * S

    @staticmethod
    def _fill(graph: _Graph, inputs: tuple[torch.Tensor | None, ...]) -> None:
        ids, positions, token_types, mask = inputs
        B, S = ids.shape
        if graph.real.shape != (B, S):
            graph.real.zero_()  # the bucket's extra rows and columns are padding
        for static, given in ((graph.ids, ids), (graph.real, mask), (graph.positions, positions),
                              (graph.token_types, token_types)):
            if given is not None:
                static[:B, :S].copy_(given)

    def _build(self, key: GraphKey, inputs: tuple[torch.Tensor | None, ...]) -> _Graph:
        while len(self.graphs) >= self.max_graphs:
            evicted, _ = self.graphs.popitem(last=False)
            self.unpadded = {shape: kept for shape, kept in self.unpadded.items() if kept != evicted}
        device, bucket = inputs[0].device, key.bucket
        zeros = lambda dtype: torch.zeros(key.rows, key.columns, dtype=dtype, device=device)  # noqa: E731
        graph = _Graph(ids=zeros(torch.long), real=zeros(torch.bool),
                       positions=zeros(torch.long) if key.positions_given else None,
                       token_types=zeros(torch.long) if key.token_types_given else None, replay=lambda: None)
        self._fill(graph, inputs)  # the warm-up and capture runs see this batch, which fits the bucket

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            if self.check is not None:
                self.check(graph.ids, graph.positions, graph.token_types)
            index, offsets, slot = packed_layout(graph.real, bucket)
            # The padding sequence gathers the dummy slot past the end: id 0, position 0, token type 0.
            take = lambda t: torch.cat([t.reshape(-1), t.new_zeros(1)])[index].unsqueeze(0)  # noqa: E731
            # The dummy slot, rows * columns, is a multiple of columns: position 0 as well.
            positions = take(graph.positions) if key.positions_given else (index % key.columns).unsqueeze(0)
            types = take(graph.token_types) if key.token_types_given else index.new_zeros(1, bucket.tokens)
            # A fresh mask each run: off CUDA the attention caches a dense mask built from the offsets' values.
            mask = AttentionMask(q_len=bucket.tokens, past_len=0, causal=False, sliding_window=None,
                                 key_padding=None, cu_seqlens=offsets, max_seqlen=bucket.max_seqlen)
            hidden = self.encode(take(graph.ids), positions, types, mask)[0]
            if key.has_padding:
                hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])
            return hidden, slot

        if device.type == "cuda":
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            (graph.packed, graph.slot), graph.replay = capture(run, self.pool)
        else:
            graph.packed, graph.slot = run()

            def replay() -> None:
                packed, slot = run()
                graph.packed.copy_(packed)
                graph.slot.copy_(slot)

            graph.replay = replay
        self.graphs[key] = graph
        return graph
