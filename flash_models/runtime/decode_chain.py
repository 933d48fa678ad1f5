"""A decoder's decode step in a chain of programmatic launches (``flash_kernels.programmatic_launch``).

On a Hopper GPU a kernel launched with programmatic dependent launch starts while the one before it finishes,
but only if both take part: cuBLAS's GEMMs do not, so each projection of a decode step would break the chain
twice. Inside this module's ``programmatic_launch()`` (which the generation engine enters around a decode step;
``flash_kernels.programmatic_launch()`` alone changes only how our kernels launch) two things change how the
step launches, not what it computes:

- every inference projection the modules make (``modules.linear.dense``) of up to 16 half-precision rows runs
  as ``flash_kernels.gemv``, whose kernel takes part (``gemv_in_chain`` says which);
- a LLaMA-style block whose every projection is such a GEMV runs as ``chained_block_step`` (the decoder calls
  it where ``chains`` holds): the residual stream is carried whole, the norms run in the qkv and gate/up GEMVs'
  prologues, SwiGLU in gate/up's epilogue and the two residual adds in the out and down GEMVs' epilogues,
  each rounded where the unfused kernels round. Three kernels a layer fewer (the norms' and the activation's)
  for the same values as the block's plain forward, up to float32 summation order.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import flash_kernels
from flash_kernels._pdl import enabled as programmatic_launch_enabled
from flash_kernels.gemv import GEMV_MAX_ROWS

from ..modules.attention import Attention
from ..modules.block import PreNormBlock
from ..modules.linear import plain_linear, projections_routed_by, routed_projection
from ..modules.mlp import GatedMLP
from ..modules.recompute import is_checkpointed

# The largest weight (elements) whose projection of 2-16 rows is our few-rows GEMV in a chain. That kernel has
# one program per 16 outputs, too few to stream a big weight as fast as cuBLAS: on an H100 it made GPT-2 124M's
# batch-16 step (weights up to 2.4M elements) 13% faster (0.50 vs 0.58 ms) but LLaMA-1.1B's (4.2M-23M) 8% slower
# (1.61 vs 1.49 ms). One row always takes the GEMV (batch 1: 0.36 vs 0.52 ms, 1.08 vs 1.34). Steps timed by
# `flash-models bench generate` (ms_per_step) with and without the GEMV.
FEW_ROWS_MAX_WEIGHT = 4 << 20


def _admitted(x: torch.Tensor, weight: torch.Tensor, backend: str) -> bool:
    """Inside ``flash_kernels.programmatic_launch()`` on a GPU that supports it, no autograd or autocast, half
    precision, one row (or up to 16 for a weight of at most ``FEW_ROWS_MAX_WEIGHT``), and not the "reference"
    kernel backend."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (backend != "reference" and (rows == 1 or (rows <= GEMV_MAX_ROWS and weight.numel() <= FEW_ROWS_MAX_WEIGHT))
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)
            and programmatic_launch_enabled(x.device))


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # "triton", not the model's "auto": _admitted has checked the kernel runs here, and gemv's own "auto" keeps
    # cuBLAS, which is faster outside a chain.
    return flash_kernels.gemv(x, weight, bias, static_weight=True, backend="triton")  # a parameter


def _route(x: torch.Tensor, weight: torch.Tensor, backend: str):
    """The router ``programmatic_launch`` gives ``modules.linear.projections_routed_by``."""
    return _gemv if _admitted(x, weight, backend) else None


def gemv_in_chain(x: torch.Tensor, weight: torch.Tensor, backend: str) -> bool:
    """Whether ``modules.linear.dense`` runs ``x @ weight.T`` as our GEMV here: inside ``programmatic_launch()``
    on a GPU that supports it, for up to 16 half-precision rows without autograd (see ``_admitted``)."""
    return routed_projection(x, weight, backend) is _gemv


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True, *, early_trigger: bool = False):
    """``flash_kernels.programmatic_launch(enabled, early_trigger=...)`` for a model's decode step, with the
    step's projections routed to our GEMV where ``_admitted`` holds (see the module's docstring)."""
    with flash_kernels.programmatic_launch(enabled, early_trigger=early_trigger):
        if not enabled:
            yield
            return
        with projections_routed_by(_route):
            yield


def chains(block: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether ``chained_block_step`` runs ``block`` for the residual stream ``hidden`` (nothing pending beside
    it): a decode step in a chain through a LLaMA-style block (bias-free RMSNorms, Gemma's 1 + weight ones too,
    the stream kept in the model's dtype, a gated MLP) in eval mode, whose every projection is plain and passes
    ``gemv_in_chain``."""
    if block.training or not programmatic_launch_enabled(hidden.device):
        return False  # cheap, and false off the chain
    if is_checkpointed(block):  # activation checkpointing's wrapper: in eval its forward is the block's
        block = block._checkpoint_wrapped_module
    if not isinstance(block, PreNormBlock) or not isinstance(block.attn, Attention):
        return False
    attn, mlp = block.attn, block.mlp
    layers = (attn.qkv, attn.out_proj, mlp.gate_up, mlp.down) if isinstance(mlp, GatedMLP) else ()
    return (not block.residual_in_fp32 and bool(layers)
            and all(norm.kind == "rms_norm" and norm.bias is None for norm in (block.norm1, block.norm2))
            and all(plain_linear(layer) and gemv_in_chain(hidden, layer.weight, attn.kernel_backend) for layer in layers))


def chained_linear(x: torch.Tensor, layer: nn.Module, *, input_norm: nn.Module | None = None,
                   residual: torch.Tensor | None = None, swiglu_output: bool = False) -> torch.Tensor:
    """``layer(x)`` as one GEMV that also RMS-normalizes x with ``input_norm`` (a bias-free RMSNorm module)
    first, applies SwiGLU to a packed [gate; up] ``layer``'s output (``swiglu_output``) and/or adds ``residual``
    to the result: the norm and activation kernels and the residual add folded into the projection (see
    flash_kernels.gemv)."""
    norm = {} if input_norm is None else dict(norm_weight=input_norm.weight, norm_eps=input_norm.eps,
                                              norm_zero_centered=input_norm.zero_centered)
    return flash_kernels.gemv(x, layer.weight, layer.bias, residual=residual, swiglu_output=swiglu_output,
                              static_weight=True, backend="triton", **norm)


def chained_block_step(block: nn.Module, stream: torch.Tensor, **attn_kwargs) -> torch.Tensor:
    """``block``'s forward (a PreNormBlock, or activation checkpointing's wrapper of one, whose attributes are
    the block's) for a decode step where ``chains(block, stream)`` holds: the residual stream in, the new stream
    out (the plain forward's ``hidden + residual``). ``attn_kwargs`` are the attention's (mask, positions,
    rotary tables, KV cache), as the plain forward takes them."""
    attn, mlp = block.attn, block.mlp
    qkv = chained_linear(stream, attn.qkv, input_norm=block.norm1)
    stream = chained_linear(attn.attend_qkv(qkv, **attn_kwargs), attn.out_proj, residual=stream)
    if mlp.cfg.activation == "silu":  # the GEMV's SwiGLU epilogue: no activation kernel
        act = chained_linear(stream, mlp.gate_up, input_norm=block.norm2, swiglu_output=True)
    else:
        act = mlp.act(chained_linear(stream, mlp.gate_up, input_norm=block.norm2))
    return chained_linear(act, mlp.down, residual=stream)
