"""``linear(x, layer)``: an nn.Linear's forward with a leaner backward, for training.

Three things differ from autograd's own Linear; only the third changes a result, and only by skipping a rounding:

- Under autocast the weight is cast to bf16/fp16 for the GEMM, and autograd keeps that copy alive from the
  forward to the backward. With ``recompute_weight_cast`` the float32 parameter is kept instead (it lives
  anyway) and cast again in the backward: for LLaMA-1.1B that frees 65 MB a layer (the qkv, output and
  gate/up projections) at the cost of one cast per weight in the backward.
- On CUDA the bias gradient is one cuBLAS GEMV of the gradient against a vector of ones. torch's reduction
  over the rows of a narrow gradient is slow: on an H200, 16384 x 768 bf16 takes 25 us that way and 8.7 us as
  a GEMV (2304 wide: 35 vs 23 us; 3072: 41 vs 28 us), 0.7 ms of GPT-2 124M's step.
- On CUDA, under autocast, the weight and bias gradients of a float32 layer come out of their GEMMs in
  float32 (``torch.mm``'s ``out_dtype``; the accumulation is float32 either way) instead of being rounded to
  bf16 and cast: two launches fewer per layer. A small model's eager step is bound by the host's launches
  (``flash-models bench overhead`` gives their host cost), which cost more there than these casts take on the GPU.

Only plain nn.Linear layers with plain tensors and no hooks take this path (``plain_linear``); anything else,
and every call under torch.compile, is the layer's own forward. Without grad mode a plain layer is ``dense``:
``F.linear``, unless a launch runtime routes the projection to a kernel of its own (``projections_routed_by``:
flash_models.runtime.decode_chain runs a decode step's projections as GEMVs in a chain of programmatic
launches). Every function that may launch our kernels takes the model's kernel backend.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flash_kernels._backend import capturing_cuda_graph

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


def _product_out_in_float32(a: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a GEMM of ``a``'s dtype can write its product as ``dtype`` itself: a bf16/fp16 product as float32,
    on CUDA (``torch.mm``'s ``out_dtype``)."""
    return a.is_cuda and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16)


def mm_as(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(a @ b).to(dtype)`` for 2-D a and b, written by the GEMM itself where it can (see above)."""
    return torch.mm(a, b, out_dtype=dtype) if _product_out_in_float32(a, dtype) else (a @ b).to(dtype)


def bias_grad(dy2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of dy2 (M, N) over its rows, as ``dtype``: a GEMV against ones on CUDA (a GEMM against a ones
    column where it writes float32 itself), torch's sum elsewhere."""
    if not dy2.is_cuda:
        return dy2.sum(0).to(dtype)
    ones = _ones(dy2.shape[0], dy2)
    if _product_out_in_float32(dy2, dtype):
        return torch.mm(dy2.t(), ones.unsqueeze(1), out_dtype=dtype).view(-1)
    return torch.mv(dy2.t(), ones).to(dtype)


def linear_grads(ctx, dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 cast_weight: torch.Tensor | None = None):
    """Gradients of ``F.linear(h, weight.to(h.dtype), bias)`` for ``dy``: (dh, dweight, dbias), each None when
    ``ctx.needs_input_grad`` (input order: h, weight, bias) says it is not needed. The weight gradient is
    computed in h's dtype and given in the weight's, as autograd does for an autocast weight. ``cast_weight``
    is the forward's ``weight.to(h.dtype)`` if it was kept; else the cast is made again."""
    w = cast_weight if cast_weight is not None else weight.to(h.dtype)
    dy2, h2 = dy.reshape(-1, dy.shape[-1]), h.reshape(-1, h.shape[-1])
    dh = torch.mm(dy2, w).view(*dy.shape[:-1], w.shape[1]) if ctx.needs_input_grad[0] else None
    dweight = mm_as(dy2.t(), h2, weight.dtype) if ctx.needs_input_grad[1] else None
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


# Picks the kernel of an inference projection: ``router(x, weight, backend)`` gives ``kernel(x, weight, bias)``, or
# None for F.linear. Set by a launch runtime around the calls it launches (projections_routed_by), so that the
# modules' forwards stay the math and how their projections launch is decided in one place outside them.
_ROUTER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("flash_models_projection_router",
                                                                         default=None)


@contextlib.contextmanager
def projections_routed_by(router: Callable | None):
    """Within this block ``router`` picks the kernel of every projection ``dense`` makes (see ``_ROUTER``)."""
    token = _ROUTER.set(router)
    try:
        yield
    finally:
        _ROUTER.reset(token)


def routed_projection(x: torch.Tensor, weight: torch.Tensor, backend: str) -> Callable | None:
    """The kernel the router in effect picked for ``x @ weight.T``, or None (F.linear): always None under
    torch.compile, whose Dynamo cannot trace ``ContextVar.get`` (and whose own kernels take part in no chain)."""
    if torch.compiler.is_compiling():
        return None
    router = _ROUTER.get()
    return None if router is None else router(x, weight, backend)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for inference, or the kernel a launch runtime routed it to."""
    kernel = routed_projection(x, weight, backend)
    return F.linear(x, weight, bias) if kernel is None else kernel(x, weight, bias)
