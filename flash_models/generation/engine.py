"""The decode step, eager or replayed from a CUDA graph.

A decode step is one token per row through the whole model against a fixed KV cache. Everything it reads
lives in tensors that stay put (the cache, its device-side lengths, the rotary tables, a static token
buffer), so on CUDA the step is captured once and replayed: one launch instead of hundreds.
"""

from __future__ import annotations

import weakref

import torch

from ..models.protocols import CausalDecoder
from ..modules.kv_cache import KVCache
from ..runtime.decode_chain import programmatic_launch as programmatic_launch_context

CACHE_LEN_BUCKET = 256  # cache lengths are rounded up to this, so a captured graph serves many prompt sizes


class DecodeRunner:
    """Runs ``model.decode_step`` against one cache: eagerly, compiled (``compile``: True for inductor, or a
    torch.compile backend name), and on CUDA replayed from a captured graph (``use_cuda_graph``). With
    ``programmatic_launch`` the step's kernels are launched (and captured) inside
    ``runtime.decode_chain.programmatic_launch()`` (with its early trigger at batch 1), unless the step is compiled:
    inductor's own kernels do not take part in the chain, and a compiled step is meant to give what the plain
    eager step gives."""

    def __init__(self, model: CausalDecoder, cache: KVCache, *, use_cuda_graph: bool = True, compile: bool | str = False,
                 programmatic_launch: bool = False):
        self.model, self.cache = model, cache
        self.programmatic_launch = programmatic_launch and not compile
        self.graph: torch.cuda.CUDAGraph | None = None
        self.fast = self._tables_fixed()
        if not self.fast:
            return
        # The tables every step reads (and a graph keeps pointing at): kept alive as long as the runner.
        self.rope_tables = model.rotary.tables(cache.max_len, cache.seqlens.device) if model.rotary is not None else None
        self.step = model.decode_step
        lean = None if compile else model.lean_decode_step(cache)
        if lean is not None:  # the same step in a fraction of the per-call overhead (the CPU's)
            self.step = lean
        if compile:
            self.step = torch.compile(model.decode_step, fullgraph=True, backend="inductor" if compile is True else compile)
        if use_cuda_graph and cache.seqlens.is_cuda:
            self._capture()

    def _launch_context(self):
        """The programmatic launch setting the step runs (and is captured) in: at batch 1 each kernel also lets
        the next launch before its own wait (``early_trigger``), which measured faster there and slower at
        batch 16 (flash_kernels._pdl); its projections join the chain as our GEMV (runtime.decode_chain)."""
        return programmatic_launch_context(self.programmatic_launch, early_trigger=self.cache.batch_size == 1)

    def _tables_fixed(self) -> bool:
        """Dynamic-NTK rotary rebuilds its tables past the trained length, per length, and LongRoPE switches its
        frequencies there: such a model, once the cache can pass that length, decodes through the plain
        forward, step by step."""
        rope = self.model.decoder_config.rope
        return rope is None or not rope.length_dependent(self.cache.max_len)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,) -> next-token logits (B, V); the cache advances by one token per row."""
        if not self.fast:
            return self.model(tokens.unsqueeze(1), kv_cache=self.cache).logits[:, -1]
        self.cache.reserve(1)
        if self.graph is None:
            with self._launch_context():
                return self.step(tokens.unsqueeze(1), self.cache, self.rope_tables)
        self.static_tokens.copy_(tokens.unsqueeze(1))
        self.graph.replay()
        return self.static_logits

    def _capture(self) -> None:
        cache = self.cache
        self.static_tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.seqlens.device)
        saved_lengths, saved_bound = cache.seqlens.clone(), cache.upper_bound

        def restore() -> None:  # outside the capture: a copy inside it would replay on every step
            cache.seqlens.copy_(saved_lengths)
            cache.upper_bound = saved_bound

        def step() -> torch.Tensor:
            cache.reserve(1)
            return self.step(self.static_tokens, cache, self.rope_tables)

        # Warm up on a side stream (allocator pools, Triton autotuning, compilation), as torch.cuda.graphs asks.
        # The launches are recorded as made, so programmatic ones must be made inside the context.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self._launch_context():
            for _ in range(2):
                restore()
                step()
        torch.cuda.current_stream().wait_stream(stream)
        restore()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), self._launch_context():
            self.static_logits = step()
        # The warm-up and capture wrote into the slots at the saved lengths; the real steps overwrite them.
        restore()


# model -> {(batch, cache length, dtype): (cache, runner)}: a captured graph is tied to its cache's tensors,
# so both are kept together and reused by later calls of the same shape (capturing costs many steps).
_POOL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cache_and_runner(
    model: CausalDecoder, batch_size: int, needed_len: int, *, use_cuda_graph: bool, block_size: int | None = None,
    compile: bool | str = False, programmatic_launch: bool = False,
) -> tuple[KVCache, DecodeRunner]:
    """An empty KV cache of at least ``needed_len`` positions and the decode runner for it. On CUDA with
    graphs the pair is pooled per (batch, rounded length, dtype); elsewhere it is built fresh. A pooled pair
    serves one generation at a time: while it is busy (two live ``stream`` iterators of one shape, say), a
    second caller gets a pair of its own. The caller calls ``runner.release()`` when its generation ends."""
    pooled = use_cuda_graph and model.device.type == "cuda"
    options = dict(compile=compile, programmatic_launch=programmatic_launch)
    if not pooled:
        cache = model.new_kv_cache(batch_size, needed_len, block_size=block_size)
        return cache, _LazyRunner(model, cache, use_cuda_graph=False, **options)
    length = -(-needed_len // CACHE_LEN_BUCKET) * CACHE_LEN_BUCKET
    entries = _POOL.setdefault(model, {})
    model = weakref.proxy(model)  # pooled runners must not keep their (weakly keyed) model alive
    key = (batch_size, length, model.dtype, block_size, compile, programmatic_launch)
    if key not in entries:
        cache = model.new_kv_cache(batch_size, length, block_size=block_size)
        entries[key] = (cache, _LazyRunner(model, cache, use_cuda_graph=True, **options))
    cache, runner = entries[key]
    if runner.busy:
        cache = model.new_kv_cache(batch_size, length, block_size=block_size)
        runner = _LazyRunner(model, cache, use_cuda_graph=True, **options)
    runner.busy = True
    cache.reset()
    return cache, runner


def clear_decode_pool(model) -> None:
    """Free the pooled KV caches and CUDA graphs of ``model``."""
    _POOL.pop(model, None)


class _LazyRunner:
    """Builds (and on CUDA captures) the DecodeRunner at the first decode step, after the prefill has
    filled the cache: the capture replays from the cache state it sees."""

    def __init__(self, model, cache: KVCache, *, use_cuda_graph: bool, compile: bool | str = False,
                 programmatic_launch: bool = False):
        self.model, self.cache, self.use_cuda_graph = model, cache, use_cuda_graph
        self.options = dict(compile=compile, programmatic_launch=programmatic_launch)
        self.runner: DecodeRunner | None = None
        self.busy = False

    def release(self) -> None:
        self.busy = False

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.runner is None:
            self.runner = DecodeRunner(self.model, self.cache, use_cuda_graph=self.use_cuda_graph, **self.options)
        return self.runner(tokens)
