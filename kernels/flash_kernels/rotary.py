"""Rotary position embedding applied to q or k.

``cos``/``sin`` are tables of shape (max_positions, rotary_dim // 2), built by the module (which owns the
scaling rules). Only the first ``rotary_dim`` channels of each head rotate; the rest pass through.
Layouts: half-split (GPT-NeoX/LLaMA: channel i pairs with i + rotary_dim/2) or interleaved (GPT-J: channel
2i pairs with 2i + 1).
"""

from __future__ import annotations

import torch

from ._backend import use_triton


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
    """Plain PyTorch reference, computed in float32. x: (B, S, H, D), or (total, H, D) with cu_seqlens."""
    rotary_dim = cos.shape[-1] * 2
    c, s = _positions_cos_sin(x, cos, sin, seqlen_offsets=seqlen_offsets, position_ids=position_ids, cu_seqlens=cu_seqlens)
    c, s = c.float(), s.float()
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


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
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of every head of x (see the module docstring)."""
    rotary_dim = cos.shape[-1] * 2
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"apply_rotary: rotary_dim {rotary_dim} exceeds head dim {x.shape[-1]}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    use_triton(backend, x, op="apply_rotary", unsupported="no Triton apply_rotary kernel is built yet")
    out = apply_rotary_ref(
        x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets, position_ids=position_ids,
        cu_seqlens=cu_seqlens,
    )
    if inplace:
        x.copy_(out)
        return x
    return out
