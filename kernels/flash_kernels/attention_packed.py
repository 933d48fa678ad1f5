"""Attention over a packed qkv tensor, as the fused qkv projection of a transformer block produces it.

Same kernels and semantics as ``flash_attn_func`` / ``flash_attn_varlen_func``; what differs is the gradient.
Slicing q, k and v out of one projection output and attending over the slices makes autograd build the qkv
gradient slice by slice: a zero-filled buffer and a copy per slice, then adds between them (on GPT-2 124M,
about a tenth of a training step's GPU time). Here the backward kernels write dq, dk and dv straight into
their places in one dqkv buffer.

Layouts (the last dim is the head dim D):
- FlashAttention-2's: (B, S, 3, H, D), or (total, 3, H, D) for varlen; q, k and v have H heads each.
- Heads concatenated: (B, S, Hq + 2 * Hkv, D), or (total, Hq + 2 * Hkv, D) for varlen, heads ordered
  [q | k | v]; ``num_heads_kv`` gives Hkv (default: a third of the heads, plain multi-head attention). This is
  how GQA/MQA models lay out a fused projection.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import use_triton
from ._triton_utils import eager_function, pick, unit_last_stride
from .attention import (
    _attn_bwd_impl, _attn_fwd_impl, _check_common, _check_cu_seqlens, _check_qkv, _outputs,
    _triton_unsupported, fa2_attn_probs,
)
from .attention_ref import flash_attn_func_ref, flash_attn_varlen_func_ref


def _split(qkv: torch.Tensor, num_heads_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of q, k, v in a heads-concatenated qkv (..., Hq + 2 * Hkv, D)."""
    hq = qkv.shape[-2] - 2 * num_heads_kv
    return qkv.narrow(-2, 0, hq), qkv.narrow(-2, hq, num_heads_kv), qkv.narrow(-2, hq + num_heads_kv, num_heads_kv)


def _heads_concatenated(op: str, qkv: torch.Tensor, num_heads_kv: int | None, dense: bool) -> tuple[torch.Tensor, int]:
    """qkv in the heads-concatenated layout and Hkv, from either accepted layout; a ValueError otherwise."""
    fa2_dims, ours_dims = (5, 4) if dense else (4, 3)
    fa2_shape = "(B, S, 3, H, D)" if dense else "(total, 3, H, D)"
    ours_shape = "(B, S, Hq + 2 * Hkv, D)" if dense else "(total, Hq + 2 * Hkv, D)"
    if qkv.dim() == fa2_dims:
        if qkv.shape[-3] != 3:
            raise ValueError(f"{op}: a {fa2_dims}-D qkv must be {fa2_shape}, got {tuple(qkv.shape)}")
        heads = qkv.shape[-2]
        if num_heads_kv not in (None, heads):
            raise ValueError(f"{op}: qkv {fa2_shape} has {heads} heads for each of q, k, v, but num_heads_kv="
                             f"{num_heads_kv}; for GQA pass the {ours_shape} layout")
        return qkv.flatten(-3, -2), heads
    if qkv.dim() != ours_dims:
        raise ValueError(f"{op}: qkv must be {fa2_shape} or {ours_shape}, got {qkv.dim()}-D {tuple(qkv.shape)}")
    total_heads = qkv.shape[-2]
    if num_heads_kv is None:
        if total_heads % 3:
            raise ValueError(f"{op}: {total_heads} heads do not split into equal q, k, v; pass num_heads_kv for GQA")
        num_heads_kv = total_heads // 3
    hq = total_heads - 2 * num_heads_kv
    if num_heads_kv < 1 or hq < num_heads_kv or hq % num_heads_kv:
        raise ValueError(f"{op}: {total_heads} heads with num_heads_kv={num_heads_kv} leave {hq} q heads, which "
                         "must be a positive multiple of num_heads_kv")
    return qkv, num_heads_kv


# ----------------------------------------------------------------------------------------------------------
# Implementations and custom ops
# ----------------------------------------------------------------------------------------------------------


def _packed_fwd_impl(qkv, num_heads_kv, cu, max_seqlen, causal, scale, wl, wr, softcap, alibi, dropout_p,
                     deterministic=False):
    q, k, v = _split(qkv, num_heads_kv)
    return _attn_fwd_impl(q, k, v, cu, cu, max_seqlen, max_seqlen, causal, scale, wl, wr, softcap, alibi, dropout_p)


def _packed_bwd_impl(dout, qkv, out, lse, num_heads_kv, cu, max_seqlen, causal, scale, wl, wr, softcap, alibi,
                     dropout_p, rng_state, deterministic=False):
    dqkv = torch.empty_like(qkv)
    _attn_bwd_impl(dout, *_split(qkv, num_heads_kv), out, lse, cu, cu, max_seqlen, max_seqlen, causal, scale, wl, wr,
                   softcap, alibi, dropout_p, rng_state, deterministic, grads=_split(dqkv, num_heads_kv))
    return dqkv


@torch.library.custom_op("flash_kernels::attn_qkvpacked_fwd", mutates_args=())
def _packed_fwd_op(
    qkv: torch.Tensor, num_heads_kv: int, cu_seqlens: Optional[torch.Tensor], max_seqlen: int, causal: bool,
    softmax_scale: float, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
    dropout_p: float, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _packed_fwd_impl(qkv, num_heads_kv, cu_seqlens, max_seqlen, causal, softmax_scale, window_left,
                            window_right, softcap, alibi_slopes, dropout_p)


@_packed_fwd_op.register_fake
def _(qkv, num_heads_kv, cu_seqlens, max_seqlen, causal, softmax_scale, window_left, window_right, softcap,
      alibi_slopes, dropout_p, deterministic=False):
    hq = qkv.shape[-2] - 2 * num_heads_kv
    out = qkv.new_empty((*qkv.shape[:-2], hq, qkv.shape[-1]))
    if cu_seqlens is not None:
        lse = qkv.new_empty(hq, qkv.shape[0], dtype=torch.float32)
    else:
        lse = qkv.new_empty(qkv.shape[0], hq, qkv.shape[1], dtype=torch.float32)
    return out, lse, qkv.new_empty((1,) if dropout_p > 0 else (0,), dtype=torch.int64)


@torch.library.custom_op("flash_kernels::attn_qkvpacked_bwd", mutates_args=())
def _packed_bwd_op(
    dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, num_heads_kv: int,
    cu_seqlens: Optional[torch.Tensor], max_seqlen: int, causal: bool, softmax_scale: float, window_left: int,
    window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float, rng_state: torch.Tensor,
    deterministic: bool = False,
) -> torch.Tensor:
    return _packed_bwd_impl(dout, qkv, out, lse, num_heads_kv, cu_seqlens, max_seqlen, causal, softmax_scale,
                            window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic)


@_packed_bwd_op.register_fake
def _(dout, qkv, out, lse, num_heads_kv, cu_seqlens, max_seqlen, causal, softmax_scale, window_left, window_right,
      softcap, alibi_slopes, dropout_p, rng_state, deterministic=False):
    return torch.empty_like(qkv)


def _setup_context(ctx, inputs, output):
    qkv, num_heads_kv, cu, max_seqlen, causal, scale, wl, wr, softcap, alibi, dropout_p = inputs[:11]
    deterministic = bool(inputs[11]) if len(inputs) > 11 else False  # a direct op call may leave it out
    out, lse, rng_state = output
    ctx.mark_non_differentiable(lse, rng_state)  # as the reference's (and FA2's) lse: no gradient flows back from it
    ctx.save_for_backward(qkv, out, lse, rng_state, cu, alibi)
    ctx.args = (num_heads_kv, max_seqlen, causal, scale, wl, wr, softcap, dropout_p, deterministic)


def _backward_with(bwd):
    """The backward, calling ``bwd``: the custom op (traced by torch.compile) or its implementation (eager)."""

    def backward(ctx, dout, _dlse, _drng):
        qkv, out, lse, rng_state, cu, alibi = ctx.saved_tensors
        num_heads_kv, max_seqlen, causal, scale, wl, wr, softcap, dropout_p, deterministic = ctx.args
        dqkv = bwd(dout, qkv, out, lse, num_heads_kv, cu, max_seqlen, causal, scale, wl, wr, softcap, alibi,
                   dropout_p, rng_state, deterministic)
        return dqkv, None, None, None, None, None, None, None, None, None, None, None

    return backward


_packed_fwd_op.register_autograd(_backward_with(_packed_bwd_op), setup_context=_setup_context)
_packed_eager = eager_function("FlashAttentionQKVPacked", _packed_fwd_impl, _setup_context,
                               _backward_with(_packed_bwd_impl))


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------


def _attend_packed(op, qkv, num_heads_kv, cu_seqlens, max_seqlen, *, causal, softmax_scale, window_size, softcap,
                   alibi_slopes, dropout_p, deterministic, return_lse, return_attn_probs, backend):
    """Shared by both public functions once qkv is heads-concatenated and (for varlen) cu_seqlens is checked."""
    q, k, v = _split(qkv, num_heads_kv)
    dense = cu_seqlens is None
    _check_qkv(op, q, k, v, 4 if dense else 3)
    batch = qkv.shape[0] if dense else cu_seqlens.numel() - 1
    _check_common(op, window_size=window_size, softcap=softcap, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                  batch=batch, hq=q.shape[-2], device=qkv.device)
    if return_attn_probs:
        fa2_attn_probs(op, dropout_p)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    common = dict(causal=causal, softmax_scale=scale, window_size=window_size, softcap=softcap,
                  alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=True)
    if not use_triton(backend, qkv, op=op, unsupported=_triton_unsupported(q)):
        if dense:
            out, lse = flash_attn_func_ref(q, k, v, **common)
        else:
            out, lse = flash_attn_varlen_func_ref(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, **common)
        return _outputs(out, lse, return_lse, return_attn_probs)
    alibi = alibi_slopes.float().contiguous() if alibi_slopes is not None else None
    out, lse, _ = pick(_packed_fwd_op, _packed_eager)(
        unit_last_stride(qkv), num_heads_kv, unit_last_stride(cu_seqlens), int(max_seqlen), causal, float(scale), int(window_size[0]),
        int(window_size[1]), float(softcap), alibi, float(dropout_p), bool(deterministic),
    )
    return _outputs(out, lse, return_lse, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    num_heads_kv: int | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """``flash_attn_func`` over a packed qkv: (B, S, 3, H, D) or (B, S, Hq + 2 * Hkv, D) (see the module
    docstring) -> (B, S, Hq, D) [, lse (B, Hq, S)]. The gradient comes back as one tensor shaped like qkv.
    FlashAttention-2's signature (see ``flash_attn_func``); ``num_heads_kv`` (GQA) is ours, keyword-only."""
    op = "flash_attn_qkvpacked_func"
    qkv, num_heads_kv = _heads_concatenated(op, qkv, num_heads_kv, dense=True)
    return _attend_packed(op, qkv, num_heads_kv, None, qkv.shape[1], causal=causal, softmax_scale=softmax_scale,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                          deterministic=deterministic, return_lse=return_lse,
                          return_attn_probs=return_attn_probs, backend=backend)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    num_heads_kv: int | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """``flash_attn_varlen_func`` over a packed qkv: (total, 3, H, D) or (total, Hq + 2 * Hkv, D), sequence b
    being rows cu_seqlens[b]:cu_seqlens[b+1] (int32) -> (total, Hq, D) [, lse (Hq, total)]."""
    op = "flash_attn_varlen_qkvpacked_func"
    qkv, num_heads_kv = _heads_concatenated(op, qkv, num_heads_kv, dense=False)
    longest = _check_cu_seqlens(op, "cu_seqlens", cu_seqlens, qkv.shape[0], qkv.device, max_seqlen)
    if longest is not None and longest > max_seqlen:
        raise ValueError(f"{op}: max_seqlen ({max_seqlen}) is smaller than the longest sequence ({longest})")
    return _attend_packed(op, qkv, num_heads_kv, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                          deterministic=deterministic, return_lse=return_lse,
                          return_attn_probs=return_attn_probs, backend=backend)
