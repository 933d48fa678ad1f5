"""``linear(x, layer)``: an nn.Linear's forward with a leaner backward, for training.

Two things differ from autograd's own Linear, neither in the result:

- Under autocast the weight is cast to bf16/fp16 for the GEMM, and autograd keeps that copy alive from the
  forward to the backward. With ``recompute_weight_cast`` the float32 parameter is kept instead (it lives
  anyway) and cast again in the backward: for LLaMA-1.1B that frees 65 MB a layer (the qkv, output and
  gate/up projections) at the cost of one cast per weight in the backward.
- The bias gradient is ``flash_kernels.column_sum``, accumulated and returned in float32: inside a captured
  CUDA graph (``train.cuda_graphs``) a two-pass Triton reduction near copy speed, where torch's reduction
  over the rows of a narrow gradient (16384 x 768 for GPT-2) runs at about a fifth of the copy bandwidth on
  an H200; in eager steps, which launch cost bounds, torch's one launch.

Only plain nn.Linear layers with plain tensors and no hooks take this path (``plain_linear``); anything else,
and every call under torch.compile or without grad mode, is the layer's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import flash_kernels
from flash_kernels._backend import capturing_cuda_graph


def linear_grads(ctx, dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 cast_weight: torch.Tensor | None = None):
    """Gradients of ``F.linear(h, weight.to(h.dtype), bias)`` for ``dy``: (dh, dweight, dbias), each None when
    ``ctx.needs_input_grad`` (input order: h, weight, bias) says it is not needed. The weight gradient is
    computed in h's dtype and cast to the weight's, as autograd does for an autocast weight. ``cast_weight``
    is the forward's ``weight.to(h.dtype)`` if it was kept; else the cast is made again."""
    w = cast_weight if cast_weight is not None else weight.to(h.dtype)
    dy2, h2 = dy.reshape(-1, dy.shape[-1]), h.reshape(-1, h.shape[-1])
    dh = dy @ w if ctx.needs_input_grad[0] else None
    dweight = (dy2.t() @ h2).to(weight.dtype) if ctx.needs_input_grad[1] else None
    dbias = None
    if bias is not None and ctx.needs_input_grad[2]:
        # Eager steps are bound by launch cost, which two Triton launches raise more than their faster GPU
        # pass saves; inside a captured CUDA graph only GPU time counts. So "auto" sums with torch in eager.
        backend = ctx.kernel_backend
        if backend == "auto" and dy.is_cuda and not capturing_cuda_graph():
            backend = "reference"
        dbias = flash_kernels.column_sum(dy2, dtype=bias.dtype, backend=backend)
    return dh, dweight, dbias


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, kernel_backend, recompute_weight_cast):
        h, w, b = x, weight, bias
        if torch.is_autocast_enabled(x.device.type):  # the casts autocast would make for F.linear
            dtype = torch.get_autocast_dtype(x.device.type)
            h, w, b = x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None
        keep_cast = w is not weight and not recompute_weight_cast
        ctx.save_for_backward(h, weight, bias, w if keep_cast else None)
        ctx.kernel_backend = kernel_backend
        return F.linear(h, w, b)

    @staticmethod
    def backward(ctx, dy):
        h, weight, bias, cast_weight = ctx.saved_tensors
        dh, dweight, dbias = linear_grads(ctx, dy, h, weight, bias, cast_weight)
        return dh, dweight, dbias, None, None


def plain_linear(layer: nn.Module) -> bool:
    """A plain nn.Linear with plain tensors and no hooks: calling its weights directly changes nothing else
    (tensor-parallel DTensors, adapter subclasses and hooked layers keep their own forward)."""
    return (type(layer) is nn.Linear and not layer._forward_hooks and not layer._forward_pre_hooks
            and not hasattr(layer.weight, "full_tensor"))


def linear(x: torch.Tensor, layer: nn.Module, *, kernel_backend: str = "auto",
           recompute_weight_cast: bool = False) -> torch.Tensor:
    """``layer(x)`` for an nn.Linear; with autograd recording, the leaner backward described above."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and plain_linear(layer):
        return _Linear.apply(x, layer.weight, layer.bias, kernel_backend, recompute_weight_cast)
    return layer(x)
