"""Inference replayed from CUDA graphs: the capture every graphed model shares, and a per-shape graph cache.

Why: a transformer forward on a Hopper GPU launches a few hundred kernels, and at inference batch sizes the
host can take longer to launch them than the GPU to run them (`flash-models bench overhead`). A captured graph launches
them all at once. A graph fixes its shapes and addresses, so ``GraphedInference`` keeps one graph per input
signature (shapes, dtypes, devices), with static input buffers the call's tensors are copied into.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch


def capture(run: Callable[[], object], pool) -> tuple[object, Callable[[], None]]:
    """Capture ``run()`` into a CUDA graph in the memory ``pool``; returns (its output, the replay function).
    Warms up on a side stream first (allocator, Triton autotuning and compilation), as torch.cuda.graphs asks."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return out, graph.replay


def replays_graph(module: torch.nn.Module, graphed, x: torch.Tensor) -> bool:
    """Whether a model with graphs enabled (``graphed`` not None) takes them for input ``x``: CUDA input, eval
    mode, no autograd, and not while torch.compile traces (the compiled graph is the alternative)."""
    return (graphed is not None and x.is_cuda and not torch.is_grad_enabled() and not module.training
            and not torch.compiler.is_compiling())


class WeightsWatch:
    """Notices when a module's weights move (``model.to(...)``, ``.half()``): a captured graph reads them at the
    addresses it saw, so graphs must then be captured again. Watches the first parameter (object, storage
    address, dtype, device), which any whole-model move changes: about a microsecond per check."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.seen = self._state()

    def _state(self) -> tuple | None:
        first = next(self.module.parameters(), None)
        return None if first is None else (id(first), first.data_ptr(), first.dtype, first.device)

    def moved(self) -> bool:
        """True once after each move."""
        now = self._state()
        if now == self.seen:
            return False
        self.seen = now
        return True


Outputs = tuple[torch.Tensor | None, ...]


class GraphedInference:
    """``fn(*inputs) -> tuple of tensors (or None)`` replayed from a CUDA graph per input signature.

    Each call copies its inputs into the signature's static buffers, replays, and returns clones of the
    outputs (ordinary tensors the caller may keep or change; the next replay overwrites the graph's own).
    Graphs share one memory pool; the ``max_graphs`` most recently used are kept, and all are dropped when
    ``module`` (the model whose weights ``fn`` reads) has moved since they were captured. The caller decides when
    to take this path (eval mode, no autograd). Off CUDA (tests) the same static buffers are run eagerly.
    """

    def __init__(self, fn: Callable[..., Outputs], module: torch.nn.Module, *, max_graphs: int = 8):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        self.fn, self.max_graphs = fn, max_graphs
        self.weights = WeightsWatch(module)
        self.graphs: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], Outputs, Callable[[], None]]] = OrderedDict()
        self.pool = None

    @staticmethod
    def signature(inputs: tuple[torch.Tensor, ...]) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)

    def __call__(self, *inputs: torch.Tensor) -> Outputs:
        if self.weights.moved():
            self.graphs.clear()
            self.pool = None  # the weights may be on another device now
        sig = self.signature(inputs)
        # The static buffers and graph outputs are inference tensors, changed only in inference mode; the
        # clones are made outside it, as ordinary tensors.
        with torch.inference_mode():
            if sig not in self.graphs:
                self._build(sig, inputs)
            self.graphs.move_to_end(sig)
            static_inputs, outputs, replay = self.graphs[sig]
            for buffer, value in zip(static_inputs, inputs):
                buffer.copy_(value)
            replay()
        return tuple(None if out is None else out.clone() for out in outputs)

    def _build(self, sig: tuple, inputs: tuple[torch.Tensor, ...]) -> None:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        static_inputs = tuple(t.detach().clone() for t in inputs)
        run = lambda: self.fn(*static_inputs)  # noqa: E731
        if static_inputs[0].is_cuda:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            outputs, replay = capture(run, self.pool)
        else:  # tests off CUDA: the same static buffers, recomputed eagerly at each replay
            outputs = run()

            def replay() -> None:
                for buffer, value in zip(outputs, run()):
                    if buffer is not None:
                        buffer.copy_(value)
        self.graphs[sig] = (static_inputs, outputs, replay)
