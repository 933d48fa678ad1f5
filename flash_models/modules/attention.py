"""Multi-head attention with a fused qkv projection: MHA, GQA and MQA, rotary, causal and padding masks,
sliding windows, a KV cache, and explicit backends ("eager", "sdpa", "flash", "auto")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import flash_kernels

from ..config import ATTN_IMPLS, AttentionConfig, RopeConfig, check_choice
from .kv_cache import KVCache

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)


def build_attention_mask(
    attention_mask: torch.Tensor | None, *, q_len: int, past_len: int, causal: bool, sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, Sq, Sk), True where a query may attend to a key, or None when plain causal
    attention (or none at all) says it all: no padding, no window, and Sq == Sk or a single query.

    ``attention_mask`` is HF's (B, past_len + Sq) tensor, 1 for real tokens and 0 for padding. Query i sits
    at key index past_len + i: causal masking is aligned bottom-right.
    """
    k_len = past_len + q_len
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} positions but the keys span {k_len} "
            f"({past_len} cached + {q_len} new); pass a mask over all cached and new tokens"
        )
    if attention_mask is None and sliding_window is None and (not causal or q_len == k_len or q_len == 1):
        return None
    return dense_attention_mask(
        attention_mask, q_len=q_len, past_len=past_len, causal=causal, sliding_window=sliding_window, device=device
    )


def dense_attention_mask(attention_mask, *, q_len, past_len, causal, sliding_window, device) -> torch.Tensor:
    """The (B or 1, 1, Sq, Sk) boolean mask, always materialized (see ``build_attention_mask``)."""
    k_len = past_len + q_len
    q_idx = torch.arange(past_len, k_len, device=device).unsqueeze(1)  # (Sq, 1)
    k_idx = torch.arange(k_len, device=device).unsqueeze(0)  # (1, Sk)
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_idx <= q_idx
    if sliding_window is not None:
        allowed &= q_idx - k_idx < sliding_window
    allowed = allowed[None, None]  # (1, 1, Sq, Sk)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed


def _eager_attention(q, k, v, mask, *, scale, dropout_p):
    """Readable reference: scores in float32, softmax, weighted sum. q (B, H, Sq, D), k/v (B, H, Sk, D)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(probs.to(v.dtype), v)


class Attention(nn.Module):
    def __init__(
        self, cfg: AttentionConfig, *, layer_idx: int, rope: RopeConfig | None = None, attn_impl: str = "auto",
    ):
        super().__init__()
        check_choice("attn_impl", attn_impl, ATTN_IMPLS)
        self.cfg, self.layer_idx, self.rope, self.attn_impl = cfg, layer_idx, rope, attn_impl
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.out_bias)
        self.softmax_scale = cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        if attn_impl == "flash":
            raise ValueError(
                "attn_impl='flash' needs flash_kernels.flash_attn_func, which this build does not have yet; "
                "use attn_impl='sdpa' or 'auto'"
            )

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None, position_ids: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None, kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x (B, S, hidden); mask from ``build_attention_mask``; position_ids (B, S); rope_tables the model's
        (cos, sin) covering every position in position_ids."""
        cfg = self.cfg
        B, S, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = q.view(B, S, cfg.num_heads, cfg.head_dim)  # (B, S, Hq, D)
        k = k.view(B, S, cfg.num_kv_heads, cfg.head_dim)  # (B, S, Hkv, D)
        v = v.view(B, S, cfg.num_kv_heads, cfg.head_dim)
        if self.rope is not None:
            cos, sin = rope_tables
            q = flash_kernels.apply_rotary(q, cos, sin, interleaved=self.rope.interleaved, position_ids=position_ids)
            k = flash_kernels.apply_rotary(k, cos, sin, interleaved=self.rope.interleaved, position_ids=position_ids)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = self._attend(q, k, v, mask)  # (B, S, Hq, D)
        return self.out_proj(out.reshape(B, S, cfg.num_heads * cfg.head_dim))

    def _attend(self, q, k, v, mask):
        """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) -> (B, Sq, Hq, D). Fully masked query rows give zeros."""
        dropout_p = self.cfg.dropout_p if self.training else 0.0
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
        row_has_keys = None
        if mask is not None:
            row_has_keys = mask.any(dim=-1, keepdim=True)  # (B, 1, Sq, 1)
            # A row with no key would be NaN after softmax: let it see everything, then zero it below.
            mask = mask | ~row_has_keys
        is_causal = mask is None and self.cfg.causal and q.shape[2] > 1
        if self.attn_impl == "eager":
            if is_causal:
                q_len, k_len = q.shape[2], k.shape[2]
                mask = dense_attention_mask(
                    None, q_len=q_len, past_len=k_len - q_len, causal=True, sliding_window=None, device=q.device
                )
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = _eager_attention(q, k, v, mask, scale=self.softmax_scale, dropout_p=dropout_p)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        if row_has_keys is not None:
            out = out * row_has_keys
        return out.transpose(1, 2)
