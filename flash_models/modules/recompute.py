"""Activations recomputed in the backward instead of kept from the forward.

``activation_then_linear``: ``linear(act(pre))`` that keeps ``pre`` for the backward but not ``act(pre)``.

In an MLP the activation's output (N, intermediate) is saved by the down projection for its weight gradient,
next to the activation's own input. Recomputing the activation in the backward (one elementwise kernel) frees
that tensor for every layer until the backward reaches it: for LLaMA-1.1B at 4 x 2048 tokens, 92 MB a layer.

The backward does what autograd does for ``linear(act(pre))`` under autocast: the weight is used in the
activation's dtype and its gradient cast back, so the gradients match the plain path (the bias gradient is
``modules.linear``'s GEMV).

``NormedInput`` / ``projection_of``: a pre-norm block's normalized input (N, hidden), which the projection
reading it would save, is recomputed from the residual stream the norm keeps anyway (one norm kernel in the
backward): for LLaMA-1.1B at 4 x 2048 tokens, 64 MB a layer. A plain nn.Linear projection saves the stream in
place of its input (``_NormedLinear``). Any other projection (a PEFT adapter's, a hooked layer) runs its own
forward, which keeps its input (its GEMM saves a 2-D view of it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .linear import autocast_like, bias_grad, linear, linear_grads, mm_as, plain_linear


class _ActivationThenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre, weight, bias, act, act_grad):
        with torch.no_grad():
            h = act(pre)
        ctx.save_for_backward(pre, weight, bias)
        ctx.act, ctx.act_grad = act, act_grad
        return F.linear(h, weight.to(h.dtype), bias.to(h.dtype) if bias is not None else None)

    @staticmethod
    def backward(ctx, dy):
        pre, weight, bias = ctx.saved_tensors
        if ctx.act_grad is None:  # act differentiated by autograd: its output recomputed first
            with torch.enable_grad():
                pre_ = pre.detach().requires_grad_()
                h = ctx.act(pre_)
            dh, dweight, dbias = linear_grads(ctx, dy, h.detach(), weight, bias)
            dpre = torch.autograd.grad(h, pre_, dh)[0] if dh is not None else None
            return dpre, dweight, dbias, None, None
        # The output's gradient needs only the weight, so it comes first; then one pass recomputes the
        # activation and takes its gradient, and the weight gradient reads the recomputed output.
        dy2 = dy.reshape(-1, dy.shape[-1])
        dpre = h = None
        if ctx.needs_input_grad[0]:
            dh = torch.mm(dy2, weight.to(pre.dtype)).view(*dy.shape[:-1], weight.shape[1])
            dpre, h = ctx.act_grad(pre, dh)
        dweight = dbias = None
        if ctx.needs_input_grad[1]:
            if h is None:
                with torch.no_grad():
                    h = ctx.act(pre)
            dweight = mm_as(dy2.t(), h.reshape(-1, h.shape[-1]), weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = bias_grad(dy2, bias.dtype)
        return dpre, dweight, dbias, None, None


def activation_then_linear(pre: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], layer: nn.Module, *,
                           backend: str, recompute: bool = True, recompute_weight_cast: bool = False,
                           act_grad: Callable | None = None) -> torch.Tensor:
    """``linear(act(pre))``, recomputing ``act`` in the backward when autograd records and ``recompute`` is
    set (the weight is then always cast again in the backward; without recompute, ``recompute_weight_cast``
    says, see modules/linear.py). ``act_grad(pre, dh)`` gives ``(dpre, act(pre))`` from one pass (the backward
    recomputes and differentiates the activation at once); without it autograd differentiates ``act``. Under
    torch.compile the plain form is traced: the compiler makes its own recompute choices. ``backend`` is the
    model's kernel backend, for ``linear``."""
    if recompute and torch.is_grad_enabled() and not torch.compiler.is_compiling() and plain_linear(layer):
        return _ActivationThenLinear.apply(pre, layer.weight, layer.bias, act, act_grad)
    return linear(act(pre), layer, backend=backend, recompute_weight_cast=recompute_weight_cast)


def _normalized(norm, stream: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``norm``'s output for the residual ``stream`` again, as the forward gave it (the fused norm normalizes the
    stream as stored, so the bits are the same)."""
    with torch.no_grad():
        return norm.normalize_stream(stream, dtype)


class NormedInput:
    """A pre-norm block's normalized input ``normed`` = ``norm``(``stream``), for the projection that reads it.
    Made only while autograd records (``normed_input``); it lives for one sublayer's forward."""

    __slots__ = ("normed", "norm", "stream")

    def __init__(self, normed: torch.Tensor, norm, stream: torch.Tensor):
        self.normed, self.norm, self.stream = normed, norm, stream


def normed_input(normed: torch.Tensor, norm, stream: torch.Tensor) -> NormedInput | None:
    """``normed`` (``norm``'s output for the residual ``stream``) to be recomputed in the backward; None without
    autograd recording, or under torch.compile (which makes its own recompute choices)."""
    if not (torch.is_grad_enabled() and normed.requires_grad) or torch.compiler.is_compiling():
        return None
    return NormedInput(normed, norm, stream)


class _NormedLinear(torch.autograd.Function):
    """``modules.linear``'s _Linear for an input that a norm made from a residual stream: the stream is saved in
    place of the input, which the backward normalizes again."""

    @staticmethod
    def forward(ctx, x, weight, bias, stream, norm, recompute_weight_cast):
        h, w, b = autocast_like(x, weight, bias)
        keep_cast = w is not weight and not recompute_weight_cast
        ctx.save_for_backward(stream, weight, bias, w if keep_cast else None)
        ctx.norm, ctx.x_dtype, ctx.h_dtype = norm, x.dtype, h.dtype
        return F.linear(h, w, b)

    @staticmethod
    def backward(ctx, dy):
        stream, weight, bias, cast_weight = ctx.saved_tensors
        h = _normalized(ctx.norm, stream, ctx.x_dtype)
        h = h if h.dtype == ctx.h_dtype else h.to(ctx.h_dtype)  # as autocast_like cast it
        dh, dweight, dbias = linear_grads(ctx, dy, h, weight, bias, cast_weight)
        return dh, dweight, dbias, None, None, None


def projection_of(x: torch.Tensor, layer: nn.Module, *, normed: NormedInput | None, backend: str,
                  recompute_weight_cast: bool = False) -> torch.Tensor:
    """``linear(x, layer)`` (see modules/linear.py) that recomputes ``x`` in the backward where ``normed`` says
    it is a norm's output (see the module docstring); ``normed`` None is ``linear`` itself."""
    if normed is None or normed.normed is not x or torch.compiler.is_compiling() or not plain_linear(layer):
        return linear(x, layer, backend=backend, recompute_weight_cast=recompute_weight_cast)
    return _NormedLinear.apply(x, layer.weight, layer.bias, normed.stream, normed.norm, recompute_weight_cast)


def checkpoint_blocks(blocks: nn.ModuleList, *, every: int = 1, use_reentrant: bool = False, **checkpoint_kwargs) -> None:
    """Activation checkpointing: every ``every``-th block keeps only its inputs and runs its forward again in the
    backward (torch.utils.checkpoint; non-reentrant unless asked, RNG state preserved so dropout recomputes
    identically; ``checkpoint_kwargs`` go to it). The wrapper strips its own prefix from state-dict keys, so
    checkpoints read the same with it on or off. A wrapped block recomputes everything, so its own saved-norm
    recompute is turned off."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if every < 1:
        raise ValueError(f"checkpoint every n-th block needs n >= 1, got {every}")
    impl = CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT
    for i in range(0, len(blocks), every):
        if is_checkpointed(blocks[i]):
            continue
        block = blocks[i]
        if getattr(block, "recompute_norm_outputs", False):  # pre-norm blocks only
            block.recompute_norm_outputs = False
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl, **checkpoint_kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(block, CheckpointWrapper)
