"""Transformer blocks with the ``(hidden, residual)`` contract.

A block receives the previous block's output ``hidden`` and the residual stream ``residual`` (None before the
first block) and returns both. The residual add is folded into the next norm, so dropout + add + norm is
one fused kernel: ``hidden, residual = norm(dropout(hidden) + residual)``.
"""

from __future__ import annotations

import torch
from torch import nn


class PreNormBlock(nn.Module):
    """GPT-2 / LLaMA:  r = r + drop(h);  h = attn(norm1(r));  r = r + drop(h);  h = mlp(norm2(r))."""

    def __init__(self, *, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 input_dropout_p: float, residual_dropout_p: float, residual_in_fp32: bool = False):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        self.input_dropout_p, self.residual_dropout_p = input_dropout_p, residual_dropout_p
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, **attn_kwargs):
        hidden, residual = self.norm1(
            hidden, residual, prenorm=True, dropout_p=self.input_dropout_p, residual_in_fp32=self.residual_in_fp32
        )
        hidden = self.attn(hidden, **attn_kwargs)
        hidden, residual = self.norm2(
            hidden, residual, prenorm=True, dropout_p=self.residual_dropout_p, residual_in_fp32=self.residual_in_fp32
        )
        return self.mlp(hidden), residual
