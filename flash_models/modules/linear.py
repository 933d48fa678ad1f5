"""``linear(x, layer)``: an nn.Linear's forward with a leaner backward, for training.

Two things differ from autograd's own Linear, neither in the result:

- Under autocast the weight is cast to bf16/fp16 for the GEMM, and autograd keeps that copy alive from the
  forward to the backward. With ``recompute_weight_cast`` the float32 parameter is kept instead (it lives
  anyway) and cast again in the backward: for LLaMA-1.1B that frees 65 MB a layer (the qkv, output and
  gate/up projections) at the cost of one cast per weight in the backward.
- On CUDA the bias gradient is one cuBLAS GEMV of the gradient against a vector of ones (float32
  accumulation, rounded to the gradient's dtype as autograd's own sum is). torch's reduction over the rows of
  a narrow gradient is slow: on an H200, 16384 x 768 bf16 takes 25 us that way and 8.7 us as a GEMV (2304
  wide: 35 vs 23 us; 3072: 41 vs 28 us), 0.7 ms of GPT-2 124M's step.

Only plain nn.Linear layers with plain tensors and no hooks take this path (``plain_linear``); anything else,
and every call under torch.compile, is the layer's own forward. Without grad mode a plain layer is ``dense``:
``F.linear``, or inside ``flash_kernels.programmatic_launch()`` (a decode step) for up to 16 half-precision
rows, ``flash_kernels.gemv``, whose kernel takes part in the chain of programmatic launches that cuBLAS's do not.
Every function that may launch our kernels takes the model's kernel backend: "reference" never takes the GEMV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import flash_kernels
from flash_kernels._backend import capturing_cuda_graph
from flash_kernels._pdl import enabled as programmatic_launch_enabled
from flash_kernels.gemv import GEMV_MAX_ROWS

_ONES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _ones(n: int, like: torch.Tensor) -> torch.Tensor:
    """n ones on like's device and dtype, from a vector cached per device and dtype (no fill launch per call).
    One made while a CUDA graph is captured lives in the graph's memory pool, so it is not cached."""
    key = (like.device, like.dtype)
    ones = _ONES.get(key)
    if ones is None or ones.numel() < n:
        ones = torch.ones(n, device=like.device, dtype=like.dtype)
        if not capturing_cuda_graph():
            _ONES[key] = ones
    return ones[:n]


def bias_grad(dy2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of dy2 (M, N) over its rows, as ``dtype``: a GEMV against ones on CUDA, torch's sum elsewhere."""
    total = torch.mv(dy2.t(), _ones(dy2.shape[0], dy2)) if dy2.is_cuda else dy2.sum(0)
    return total.to(dtype)


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
    dbias = bias_grad(dy2, bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
    return dh, dweight, dbias


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes x in: autocast's where it is on for x's device, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def autocast_like(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors (an input, then weights and biases; None stays None) cast as autocast would cast them for
    ``F.linear``, where it is on for the first one's device; unchanged otherwise. For calls that autocast does
    not see: custom ops, and an autograd.Function's forward."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None else None for t in tensors)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recompute_weight_cast):
        h, w, b = autocast_like(x, weight, bias)
        keep_cast = w is not weight and not recompute_weight_cast
        ctx.save_for_backward(h, weight, bias, w if keep_cast else None)
        return F.linear(h, w, b)

    @staticmethod
    def backward(ctx, dy):
        h, weight, bias, cast_weight = ctx.saved_tensors
        dh, dweight, dbias = linear_grads(ctx, dy, h, weight, bias, cast_weight)
        return dh, dweight, dbias, None


def plain_linear(layer: nn.Module) -> bool:
    """A plain nn.Linear with plain tensors and no hooks: calling its weights directly changes nothing else
    (tensor-parallel DTensors, adapter subclasses and hooked layers keep their own forward)."""
    return (type(layer) is nn.Linear and not layer._forward_hooks and not layer._forward_pre_hooks
            and not hasattr(layer.weight, "full_tensor"))


def linear(x: torch.Tensor, layer: nn.Module, *, backend: str, recompute_weight_cast: bool = False) -> torch.Tensor:
    """``layer(x)`` for an nn.Linear; with autograd recording, the leaner backward described above."""
    if torch.compiler.is_compiling() or not plain_linear(layer):
        return layer(x)
    if torch.is_grad_enabled():
        return _Linear.apply(x, layer.weight, layer.bias, recompute_weight_cast)
    return dense(x, layer.weight, layer.bias, backend=backend)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for inference. Inside ``flash_kernels.programmatic_launch()`` on a GPU that
    supports it, up to 16 half-precision rows (a decode step up to batch 16; past one row, only for small
    weights: ``FEW_ROWS_MAX_WEIGHT``) go through ``flash_kernels.gemv`` instead: a programmatic launch only
    overlaps two kernels that both take part, and cuBLAS's do not, so every projection would otherwise break
    the chain twice."""
    if gemv_in_chain(x, weight, backend):
        # "triton", not the model's "auto": gemv_in_chain has checked the kernel runs here, and gemv's own "auto"
        # keeps cuBLAS, which is faster outside a chain.
        return flash_kernels.gemv(x, weight, bias, static_weight=True, backend="triton")  # a parameter
    return F.linear(x, weight, bias)


def chained_linear(x: torch.Tensor, layer: nn.Module, *, input_norm: nn.Module | None = None,
                   residual: torch.Tensor | None = None, swiglu_output: bool = False) -> torch.Tensor:
    """``layer(x)`` for a decode step in a chain of programmatic launches (``gemv_in_chain``) as one GEMV that also
    RMS-normalizes x with ``input_norm`` (a bias-free RMSNorm module) first, applies SwiGLU to a packed
    [gate; up] ``layer``'s output (``swiglu_output``) and/or adds ``residual`` to the result: the norm and
    activation kernels and the residual add folded into the projection (see flash_kernels.gemv). Only a block
    whose every projection passed ``gemv_in_chain`` with the model's backend calls it."""
    norm = {} if input_norm is None else dict(norm_weight=input_norm.weight, norm_eps=input_norm.eps)
    return flash_kernels.gemv(x, layer.weight, layer.bias, residual=residual, swiglu_output=swiglu_output,
                              static_weight=True, backend="triton", **norm)


# The largest weight (elements) whose projection of 2-16 rows is our few-rows GEMV in a chain. That kernel has
# one program per 16 outputs, too few to stream a big weight as fast as cuBLAS: on an H100 it made GPT-2 124M's
# batch-16 step (weights up to 2.4M elements) 13% faster (0.50 vs 0.58 ms) but LLaMA-1.1B's (4.2M-23M) 8% slower
# (1.61 vs 1.49 ms). One row always takes the GEMV (batch 1: 0.36 vs 0.52 ms, 1.08 vs 1.34). Steps timed by
# `flash-models bench generate` (ms_per_step) with and without the GEMV.
FEW_ROWS_MAX_WEIGHT = 4 << 20


def gemv_in_chain(x: torch.Tensor, weight: torch.Tensor, backend: str) -> bool:
    """Whether ``dense`` runs ``x @ weight.T`` as our GEMV (see there): never with the "reference" backend."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (backend != "reference" and (rows == 1 or (rows <= GEMV_MAX_ROWS and weight.numel() <= FEW_ROWS_MAX_WEIGHT))
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)
            and programmatic_launch_enabled(x.device))
