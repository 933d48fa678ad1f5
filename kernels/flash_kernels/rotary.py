"""Rotary position embedding applied to q or k.

``cos``/``sin`` are tables of shape (max_positions, rotary_dim // 2), built by the module (which owns the
scaling rules). Only the first ``rotary_dim`` channels of each head rotate; the rest pass through.
Layouts: half-split (GPT-NeoX/LLaMA: channel i pairs with i + rotary_dim/2) or interleaved (GPT-J: channel
2i pairs with 2i + 1).

The Triton kernel runs one program per token (and block of heads): the token's cos/sin row is read once and
reused by every head. Its backward is the same rotation by -sin.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ._backend import compute_dtype, holds_integers, use_triton
from ._launch import lean_launch
from ._pdl import enabled as programmatic_launch_enabled
from ._pdl import launch_options, wait_for_predecessor
from ._triton_compat import tl, triton
from ._triton_utils import cdiv, eager_function, next_power_of_2, pick, unit_last_stride


def _positions_cos_sin(x, cos, sin, *, seqlen_offsets, position_ids, cu_seqlens):
    """cos/sin gathered for every token, broadcastable against x's (..., S, H, rotary_dim//2) layout."""
    if position_ids is not None:
        return cos[position_ids].unsqueeze(-2), sin[position_ids].unsqueeze(-2)  # (B, S, 1, rd/2)
    if cu_seqlens is not None:  # x is (total, H, D): position = index within its own sequence
        total = x.shape[0]
        starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=total)
        pos = torch.arange(total, device=x.device) - starts
        if isinstance(seqlen_offsets, torch.Tensor):
            pos = pos + torch.repeat_interleave(seqlen_offsets, cu_seqlens.diff(), output_size=total)
        else:
            pos = pos + seqlen_offsets
        return cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)  # (total, 1, rd/2)
    seqlen = x.shape[1]
    pos = torch.arange(seqlen, device=x.device)
    if isinstance(seqlen_offsets, torch.Tensor):  # one offset per batch row
        pos = pos.unsqueeze(0) + seqlen_offsets.unsqueeze(1)  # (B, S)
        return cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)
    pos = pos + seqlen_offsets
    return cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)  # (S, 1, rd/2)


def apply_rotary_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference, computed in float32 (float64 for float64 x). x: (B, S, H, D), or (total, H, D)
    with cu_seqlens."""
    rotary_dim = cos.shape[-1] * 2
    c, s = _positions_cos_sin(x, cos, sin, seqlen_offsets=seqlen_offsets, position_ids=position_ids, cu_seqlens=cu_seqlens)
    compute = compute_dtype(x.dtype)
    c, s = c.to(compute), s.to(compute)
    xr = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    if rotary_dim == x.shape[-1]:  # nothing passes through: spare a copy
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)



# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # heads x rotary-half elements per program


# The two helpers below are the rotation itself, shared with rotary_append.py's fused decode kernel so that both
# compute it with the same float32 operations in the same order (their results are bit-identical).
# Both kernels are compiled without floating-point contraction: each output is then two rounded products and a
# rounded sum, as in apply_rotary_ref, on every GPU. With contraction the compiler fuses one product of each
# pair into an FMA, and which one it picks for the commutative x1 * s + x2 * c depends on how it ordered that
# kernel's operands: on an H100 this kernel and the fused one picked differently and differed in the last bit.
ROTATION_COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def rotary_cos_sin(
    COS, SIN, pos, max_pos, stride_cos, stride_sin, HALF, k, INTERLEAVED: tl.constexpr, CONJ: tl.constexpr,
):
    """One token's cos/sin row at ``pos`` as float32 over the rotary-half channels ``k``, and the channel pairs
    (first, second) they rotate."""
    # An out-of-table position, negative ones too, loads nothing (comparisons of scalars only: Triton 3.9's
    # interpreter rejects a block mask and'ed with a scalar condition).
    k_mask = k < tl.where((pos >= 0) & (pos < max_pos), HALF, 0)
    c = tl.load(COS + pos * stride_cos + k, mask=k_mask, other=0.0).to(tl.float32)
    sn = tl.load(SIN + pos * stride_sin + k, mask=k_mask, other=0.0).to(tl.float32)
    if CONJ:
        sn = -sn
    if INTERLEAVED:
        first, second = 2 * k, 2 * k + 1
    else:
        first, second = k, k + HALF
    return c, sn, first, second


@triton.jit
def rotate_pairs(x_rows, c, sn, first, second, mask):
    """The rotated channel pairs (o1, o2), float32 (heads, rotary half), of the heads whose channel 0 is at
    ``x_rows`` (a (heads, 1) block of pointers)."""
    x1 = tl.load(x_rows + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * sn[None, :]
    o2 = x1 * sn[None, :] + x2 * c[None, :]
    return o1, o2


@lean_launch
@triton.jit
def _rotary_kernel(
    X, OUT, COS, SIN, POS, OFFSETS, offset, S, H, ROTATED_H, HALF, max_pos,
    stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh, stride_cos, stride_sin,
    POS_MODE: tl.constexpr, INTERLEAVED: tl.constexpr, CONJ: tl.constexpr, PASS_THROUGH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """The rotary channels of heads [0, ROTATED_H) rotated into OUT; with PASS_THROUGH, those of heads
    [ROTATED_H, H) copied as they are (a packed qkv's v heads: no copy launch of their own)."""
    wait_for_predecessor(PDL)
    # POS_MODE 0: position = s + offset; 1: s + OFFSETS[b]; 2: POS[token] (position_ids or varlen positions).
    token = tl.program_id(0).to(tl.int64)
    b = token // S
    s = token % S
    if POS_MODE == 0:
        pos = s + offset
    elif POS_MODE == 1:
        pos = s + tl.load(OFFSETS + b).to(tl.int64)
    else:
        pos = tl.load(POS + token).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k = tl.arange(0, BLOCK_K)
    c, sn, first, second = rotary_cos_sin(COS, SIN, pos, max_pos, stride_cos, stride_sin, HALF, k, INTERLEAVED, CONJ)
    mask = (heads[:, None] < H) & (k[None, :] < HALF)
    x_row = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh
    o_row = OUT + b * stride_ob + s * stride_os + heads[:, None] * stride_oh
    rotated = heads[:, None] < ROTATED_H
    o1, o2 = rotate_pairs(x_row, c, sn, first, second, mask & rotated)
    if PASS_THROUGH:  # the other heads' values as loaded (exact, whatever they hold: no rotation by angle 0)
        copied = mask & (heads[:, None] >= ROTATED_H)
        o1 = tl.where(rotated, o1, tl.load(x_row + first[None, :], mask=copied, other=0.0).to(tl.float32))
        o2 = tl.where(rotated, o2, tl.load(x_row + second[None, :], mask=copied, other=0.0).to(tl.float32))
    tl.store(o_row + first[None, :], o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_row + second[None, :], o2.to(OUT.dtype.element_ty), mask=mask)


def _rotary_launch(x, out, cos, sin, positions, offsets, offset, interleaved, conj, rotated_heads=None):
    """Rotate x (B, S, H, D) into out (same shape; may be x). Only the rotary channels are written: those of
    the first ``rotated_heads`` heads (default all) rotated, those of the others copied."""
    B, S, H, _ = x.shape
    if H == 0:
        return
    rotated_heads = H if rotated_heads is None else rotated_heads
    half = cos.shape[-1]
    block_h, block_k, warps = _tile(H, half)
    mode = 2 if positions is not None else (1 if offsets is not None else 0)
    pdl = programmatic_launch_enabled(x.device)
    _rotary_kernel[(B * S, cdiv(H, block_h))](
        x, out, cos, sin, positions, offsets, offset, S, H, rotated_heads, half, cos.shape[0],
        *x.stride()[:3], *out.stride()[:3], cos.stride(0), sin.stride(0),
        POS_MODE=mode, INTERLEAVED=interleaved, CONJ=conj, PASS_THROUGH=rotated_heads < H, BLOCK_H=block_h,
        BLOCK_K=block_k, PDL=pdl, num_warps=warps, **ROTATION_COMPILE_OPTIONS, **launch_options(pdl),
    )


@functools.cache
def _tile(heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_K, num_warps) for rotating ``heads`` heads of ``half`` channel pairs (worked out once per
    shape: an eager rotary call's host time is on the critical path of short steps)."""
    block_k = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(1, _TILE // block_k))
    return block_h, block_k, 4 if block_h * block_k <= 2048 else 8


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


def _rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor], offset: int, interleaved: bool, conj: bool, rotated_heads: int,
) -> torch.Tensor:
    """x rotated out of place: the first ``rotated_heads`` heads (all of them, or q and k of a packed qkv)
    rotate in their first rotary_dim channels; every other element is copied through."""
    out = torch.empty_like(x)
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # channels the kernel does not touch, of every head
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    _rotary_launch(x, out, cos, sin, positions, offsets, offset, interleaved, conj, rotated_heads)
    return out


_rotary_op = torch.library.custom_op("flash_kernels::rotary", mutates_args=())(_rotary)


@_rotary_op.register_fake
def _(x, cos, sin, positions, offsets, offset, interleaved, conj, rotated_heads):
    return torch.empty_like(x)


@torch.library.custom_op("flash_kernels::rotary_", mutates_args=("x",))
def _rotary_inplace_op(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor], offset: int, interleaved: bool, conj: bool,
) -> None:
    _rotary_launch(x, x, cos, sin, positions, offsets, offset, interleaved, conj)


def _rotary_setup_context(ctx, inputs, output):
    x, cos, sin, positions, offsets, offset, interleaved, conj, rotated_heads = inputs
    ctx.save_for_backward(cos, sin, positions, offsets)
    ctx.args = (offset, interleaved, not conj, rotated_heads)


def _rotary_backward_with(rotate):
    def backward(ctx, dy):
        cos, sin, positions, offsets = ctx.saved_tensors
        # The rotation is orthogonal: its transpose is the rotation by -sin.
        dx = rotate(dy.contiguous() if dy.stride(-1) != 1 else dy, cos, sin, positions, offsets, *ctx.args)
        return dx, None, None, None, None, None, None, None, None

    return backward


_rotary_op.register_autograd(_rotary_backward_with(_rotary_op), setup_context=_rotary_setup_context)
_rotary_eager = eager_function("Rotary", _rotary, _rotary_setup_context, _rotary_backward_with(_rotary))


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


def _unsupported(x: torch.Tensor, cos: torch.Tensor) -> str | None:
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: float32, float16, bfloat16)"
    if cos.dtype not in _DTYPES:
        return f"cos/sin dtype {cos.dtype}"
    if x.stride(-1) != 1:
        return "a head dim that is not contiguous"
    return None


def _token_positions(x, *, seqlen_offsets, position_ids, cu_seqlens):
    """(positions per token or None, per-batch offsets or None, int offset) for the kernel's position modes."""
    if position_ids is not None:
        return position_ids.reshape(-1), None, 0
    if cu_seqlens is not None:
        total = x.shape[0]
        lengths = cu_seqlens.diff()
        pos = torch.arange(total, device=x.device) - torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + torch.repeat_interleave(seqlen_offsets, lengths, output_size=total), None, 0
        return pos + seqlen_offsets, None, 0
    if isinstance(seqlen_offsets, torch.Tensor):
        return None, seqlen_offsets, 0
    return None, None, int(seqlen_offsets)


def _check_shapes(x, cos, sin, *, seqlen_offsets, position_ids, cu_seqlens):
    rotary_dim = cos.shape[-1] * 2
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"apply_rotary: rotary_dim {rotary_dim} exceeds head dim {x.shape[-1]}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    expected = 3 if cu_seqlens is not None else 4
    if x.dim() != expected:
        layout = "(total, H, D) with cu_seqlens" if cu_seqlens is not None else "(B, S, H, D)"
        raise ValueError(f"apply_rotary: expected x of shape {layout}, got {tuple(x.shape)}")
    if position_ids is not None and position_ids.shape != x.shape[:2]:
        raise ValueError(f"apply_rotary: position_ids {tuple(position_ids.shape)} != (B, S) {tuple(x.shape[:2])}")
    if position_ids is not None and not holds_integers(position_ids):
        raise ValueError(f"apply_rotary: position_ids must be integer positions (torch.long), got {position_ids.dtype}")
    if cu_seqlens is not None and (not holds_integers(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
        raise ValueError(f"apply_rotary: cu_seqlens must be 1-D integer offsets (batch + 1,) with at least 2 entries, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else x.shape[0]
        if not holds_integers(seqlen_offsets) or seqlen_offsets.shape != (batch,):
            raise ValueError(f"apply_rotary: a seqlen_offsets tensor holds one integer offset per sequence, ({batch},), "
                             f"got {seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
    elif seqlen_offsets < 0:
        raise ValueError(f"apply_rotary: seqlen_offsets must be >= 0, got {seqlen_offsets}")
    if position_ids is None and cu_seqlens is None and isinstance(seqlen_offsets, int):
        if x.shape[1] + seqlen_offsets > cos.shape[0]:
            raise ValueError(
                f"apply_rotary: positions up to {x.shape[1] + seqlen_offsets} exceed the cos/sin table of "
                f"{cos.shape[0]} positions; build a longer table"
            )
    elif not x.is_cuda and not torch.compiler.is_compiling():
        _check_position_values(x, cos, seqlen_offsets=seqlen_offsets, position_ids=position_ids, cu_seqlens=cu_seqlens)


def _check_position_values(x, cos, *, seqlen_offsets, position_ids, cu_seqlens):
    """Every token's position lies in [0, table length), and cu_seqlens cover x's tokens. Only off CUDA, where
    reading the values costs no host sync: on CUDA the caller keeps positions inside the table, and the kernel
    reads no memory outside it (a position outside gives zeros in the rotary channels)."""
    if cu_seqlens is not None:
        offsets = cu_seqlens.tolist()
        if offsets[0] != 0 or offsets[-1] != x.shape[0] or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"apply_rotary: cu_seqlens must start at 0, not decrease and end at the {x.shape[0]} "
                             f"tokens of x, got {offsets if len(offsets) <= 20 else tuple(cu_seqlens.shape)}")
    positions = position_ids
    if positions is None:
        positions, _, _ = _token_positions(x, seqlen_offsets=seqlen_offsets, position_ids=None, cu_seqlens=cu_seqlens)
    if positions is None:  # one offset per batch row: rows reach offset + S - 1
        positions = torch.stack((seqlen_offsets, seqlen_offsets + max(x.shape[1] - 1, 0)))
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(
            f"apply_rotary: positions span [{int(positions.min())}, {int(positions.max())}], outside the cos/sin "
            f"table of {cos.shape[0]} positions; pass positions in [0, {cos.shape[0]}) or build a longer table"
        )


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    inplace: bool = False,
    num_rotated_heads: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of every head of x (see the module docstring).

    x: (B, S, H, D), or (total, H, D) with ``cu_seqlens``. Positions: ``position_ids`` (B, S) if given, else
    the index in the sequence plus ``seqlen_offsets`` (an int, or one per batch row). Gradients flow to x, not to
    the cos/sin tables. ``inplace`` overwrites x; when x needs a gradient the rotation is computed out of place
    and copied back, since autograd must keep its own copy anyway. ``num_rotated_heads`` rotates only the first
    that many heads and passes the rest through: q and k of a packed (..., Hq + 2 * Hkv, D) qkv, whose v heads
    do not rotate.
    """
    _check_shapes(x, cos, sin, seqlen_offsets=seqlen_offsets, position_ids=position_ids, cu_seqlens=cu_seqlens)
    heads = x.shape[-2]
    rotated = heads if num_rotated_heads is None else num_rotated_heads
    if not 0 <= rotated <= heads:
        raise ValueError(f"apply_rotary: num_rotated_heads={num_rotated_heads} must be in [0, {heads}] (x has {heads} heads)")
    if not use_triton(backend, x, op="apply_rotary", unsupported=_unsupported(x, cos)):
        out = apply_rotary_ref(
            x[..., :rotated, :], cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets,
            position_ids=position_ids, cu_seqlens=cu_seqlens,
        )
        if rotated < heads:
            out = torch.cat((out, x[..., rotated:, :]), dim=-2)
        return x.copy_(out) if inplace else out
    positions, offsets, offset = _token_positions(x, seqlen_offsets=seqlen_offsets, position_ids=position_ids, cu_seqlens=cu_seqlens)
    positions, offsets, cos, sin = (unit_last_stride(t) for t in (positions, offsets, cos, sin))
    x4 = x.unsqueeze(0) if cu_seqlens is not None else x  # (B, S, H, D)
    if inplace and not (torch.is_grad_enabled() and x.requires_grad):
        x_rot = x4[:, :, :rotated]
        if torch.compiler.is_compiling():
            _rotary_inplace_op(x_rot, cos, sin, positions, offsets, offset, interleaved, False)
        else:
            _rotary_launch(x_rot, x_rot, cos, sin, positions, offsets, offset, interleaved, False)
        return x
    out = pick(_rotary_op, _rotary_eager)(x4, cos, sin, positions, offsets, offset, interleaved, False, rotated)
    out = out.squeeze(0) if cu_seqlens is not None else out
    return x.copy_(out) if inplace else out
