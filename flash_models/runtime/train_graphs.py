"""Training micro-steps (forward + backward) replayed from CUDA graphs: ``train.cuda_graphs: true``.

Why: on a Hopper GPU a GPT-2-size micro-step launches a thousand-odd kernels, and the host time to launch
them (Python wrappers, autograd, the Triton launcher) can exceed their GPU time. A graph replays all of them
with one launch. ``torch.cuda.make_graphed_callables`` captures the forward and the backward of the loss once
per batch signature (the shapes and dtypes of the batch tensors); the optimizer step, gradient clipping and
accumulation stay eager (a few multi-tensor kernels).

What it needs, checked when the Trainer starts (``check_graphable``): one CUDA device, no torch.compile, no
activation checkpointing, and one of: causal LM batches without packed-document offsets (those are read on the
host); image classification (fixed image size; Mixup/CutMix runs eagerly before the graphed loss); text
classification, whose rows the collate then packs on the host into a few fixed-size buckets
(``classification.collate_packed_classification``), since unpadding a padded batch on the device reads its
mask back.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

# Every batch signature holds its own graphs, static inputs and outputs (one gradient buffer per parameter among
# them); activation memory is shared, since the captures share one memory pool. Packed text classification
# meets up to ``classification.TOKEN_BUCKETS`` signatures per row count; a run that keeps meeting new shapes
# beyond that is not what graphs are for.
MAX_SIGNATURES = 16


def check_graphable(*, device: torch.device, task: str, packing: str, compile: bool, activation_checkpointing: int,
                    strategy: str) -> None:
    """Raise ValueError naming the setting that rules out ``train.cuda_graphs``, and what to change."""
    problems = []
    if device.type != "cuda":
        problems.append(f"a CUDA device (train.device resolved to {device.type!r})")
    if compile:
        problems.append("train.compile=false (torch.compile and CUDA graphs are alternatives)")
    if activation_checkpointing:
        problems.append("train.activation_checkpointing=0")
    if strategy != "none":
        problems.append(f"distributed.strategy=none (got {strategy!r})")
    if task == "causal_lm" and packing != "stream":
        problems.append("data.packing=stream (packed documents carry cu_seqlens, which the model reads on the host)")
    if problems:
        raise ValueError("train.cuda_graphs=true needs " + "; ".join(problems))


class _LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module of positional tensors, the form make_graphed_callables takes."""

    def __init__(self, model: nn.Module, loss_fn: Callable, keys: tuple[str, ...], autocast_dtype: torch.dtype | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keys = keys
        self.autocast_dtype = autocast_dtype

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        # Autocast's weight-cast cache must be off while capturing (the graph would keep stale casts).
        ctx = (torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            return self.loss_fn(self.model, dict(zip(self.keys, tensors)))


class GraphedLoss:
    """``loss = loss_fn(model, batch)`` with forward and backward replayed from CUDA graphs, per batch signature.

    ``loss.backward()`` accumulates into the parameters' ``.grad`` as usual. The graph writes its gradients
    into static buffers that the next replay overwrites, so call ``prepare_grads(micro_steps)`` before the
    first micro-step of each optimizer step. With several micro-steps it keeps every ``.grad`` allocated and
    zeroed in place, so autograd adds into it rather than keeping the static buffer itself as ``.grad`` (the
    next micro-step's replay would overwrite it). With one, ``.grad`` is cleared and autograd keeps the static
    buffer: the optimizer reads it before the next replay rewrites it (stream order), and the step saves a
    zero fill and an add over every gradient (about 0.5 ms for GPT-2 124M on an H200).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, *, autocast_dtype: torch.dtype | None = None):
        self.model = model
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype
        self.graphed: dict[tuple, nn.Module] = {}
        # One memory pool for every signature's graphs: a micro-step replays one signature's forward and then
        # its backward, never two signatures interleaved, so their activations can share memory (each keeps
        # its own static inputs and outputs, which stay allocated).
        self.pool = None
        # make_graphed_callables warms up on a side stream, so the parameters' gradient accumulators were made
        # there; the eager backward then syncs with that idle stream once per micro-step (cheap), and torch
        # warns about it on every step.
        warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match", category=UserWarning)

    @staticmethod
    def signature(batch: dict[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))

    def prepare_grads(self, micro_steps: int) -> None:
        if micro_steps == 1:
            for p in self.model.parameters():
                p.grad = None
            return
        grads = []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        sig = self.signature(batch)
        graphed = self.graphed.get(sig)
        if graphed is None:
            graphed = self._capture(sig, batch)
        return graphed(*(batch[k] for k, _, _ in sig))

    def _capture(self, sig: tuple, batch: dict[str, torch.Tensor]) -> nn.Module:
        if len(self.graphed) >= MAX_SIGNATURES:
            seen = ", ".join(str(s) for s in self.graphed)
            raise RuntimeError(
                f"train.cuda_graphs: batch signature {sig} would be the {MAX_SIGNATURES + 1}th captured (seen: {seen}); "
                "graphs suit fixed-shape batches: fix the batch shapes or set train.cuda_graphs=false"
            )
        keys = tuple(k for k, _, _ in sig)
        module = _LossModule(self.model, self.loss_fn, keys, self.autocast_dtype)
        # Samples are copies: make_graphed_callables keeps them as the graph's static inputs.
        samples = tuple(batch[k].detach().clone() for k in keys)
        log.info("capturing the training micro-step in CUDA graphs for %s", sig)
        # allow_unused_input: a parameter the loss does not reach keeps a zero gradient instead of raising.
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graphed = torch.cuda.make_graphed_callables(module, samples, num_warmup_iters=3, allow_unused_input=True,
                                                    pool=self.pool)
        self.graphed[sig] = graphed
        return graphed
