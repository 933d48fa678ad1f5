"""Transformer blocks with the ``(hidden, residual)`` contract.

A block receives the previous block's output ``hidden`` and the residual stream ``residual`` (None before the
first block) and returns both. The residual add is folded into the next norm, so dropout + add + norm is
one fused kernel: ``hidden, residual = norm(dropout(hidden) + residual)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norm import dual_norm
from .recompute import NormedInput, normed_input


class PreNormBlock(nn.Module):
    """GPT-2 / LLaMA:  r = r + drop(h);  h = attn(norm1(r));  r = r + drop(h);  h = mlp(norm2(r)).

    ``recompute_norm_outputs``: the backward recomputes norm1(r) and norm2(r) from r (kept by the norms
    anyway) instead of keeping them: less memory for one norm kernel each in the backward. Off by default;
    the LLaMA-style decoders turn it on, and activation checkpointing (which recomputes the whole block)
    turns it off."""

    def __init__(self, *, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module,
                 input_dropout_p: float, residual_dropout_p: float, residual_in_fp32: bool = False,
                 recompute_norm_outputs: bool = False):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        self.input_dropout_p, self.residual_dropout_p = input_dropout_p, residual_dropout_p
        self.residual_in_fp32, self.recompute_norm_outputs = residual_in_fp32, recompute_norm_outputs

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, **attn_kwargs):
        hidden, residual = self.norm1(
            hidden, residual, prenorm=True, dropout_p=self.input_dropout_p, residual_in_fp32=self.residual_in_fp32
        )
        hidden = self.attn(hidden, normed=self._normed(hidden, self.norm1, residual), **attn_kwargs)
        hidden, residual = self.norm2(
            hidden, residual, prenorm=True, dropout_p=self.residual_dropout_p, residual_in_fp32=self.residual_in_fp32
        )
        return self.mlp(hidden, normed=self._normed(hidden, self.norm2, residual)), residual

    def _normed(self, normed, norm, stream) -> NormedInput | None:
        """The sublayer's input as its first projection recomputes it (``recompute_norm_outputs``), or None."""
        return normed_input(normed, norm, stream) if self.recompute_norm_outputs else None


class SandwichBlock(nn.Module):
    """Gemma 2: each sublayer's output normalized too, before it joins the stream:
    r = r + drop(h);  h = post_attn_norm(attn(norm1(r)));  r = r + h;  h = post_mlp_norm(mlp(norm2(r))).

    The add of each sublayer's normalized output into the stream is folded into the next norm (the (hidden,
    residual) contract), as in ``PreNormBlock``; the post-norms are plain norms of the sublayer outputs."""

    def __init__(self, *, norm1: nn.Module, attn: nn.Module, post_attn_norm: nn.Module, norm2: nn.Module,
                 mlp: nn.Module, post_mlp_norm: nn.Module, input_dropout_p: float, residual_dropout_p: float,
                 residual_in_fp32: bool = False):
        super().__init__()
        self.norm1, self.attn, self.post_attn_norm = norm1, attn, post_attn_norm
        self.norm2, self.mlp, self.post_mlp_norm = norm2, mlp, post_mlp_norm
        self.input_dropout_p, self.residual_dropout_p = input_dropout_p, residual_dropout_p
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, **attn_kwargs):
        hidden, residual = self.norm1(
            hidden, residual, prenorm=True, dropout_p=self.input_dropout_p, residual_in_fp32=self.residual_in_fp32
        )
        hidden = self.post_attn_norm(self.attn(hidden, **attn_kwargs))
        hidden, residual = self.norm2(
            hidden, residual, prenorm=True, dropout_p=self.residual_dropout_p, residual_in_fp32=self.residual_in_fp32
        )
        return self.post_mlp_norm(self.mlp(hidden)), residual


class ParallelBlock(nn.Module):
    """GPT-NeoX (two norms) / GPT-J (``norm2=None``: one shared norm), attention and MLP side by side:
    r = r + drop(h);  h = attn(norm1(r)) + mlp(norm2(r)).

    With two norms, both read the same ``r`` in one fused dual-norm kernel. Dropout on the sublayer outputs is
    applied once, to their sum, by the next norm (HF drops each output separately: same mean, other noise)."""

    def __init__(self, *, norm1: nn.Module, attn: nn.Module, mlp: nn.Module, norm2: nn.Module | None,
                 input_dropout_p: float, residual_in_fp32: bool = False):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        self.input_dropout_p, self.residual_in_fp32 = input_dropout_p, residual_in_fp32

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, **attn_kwargs):
        kwargs = dict(dropout_p=self.input_dropout_p, residual_in_fp32=self.residual_in_fp32)
        if self.norm2 is None:
            x, residual = self.norm1(hidden, residual, prenorm=True, **kwargs)
            return self.attn(x, **attn_kwargs) + self.mlp(x), residual
        x_attn, x_mlp, residual = dual_norm(self.norm1, self.norm2, hidden, residual, **kwargs)
        return self.attn(x_attn, **attn_kwargs) + self.mlp(x_mlp), residual


class PostNormBlock(nn.Module):
    """BERT / OPT-350m:  x = norm1(x + drop(attn(x)));  x = norm2(x + drop(mlp(x))).

    Between post-norm blocks the stream is already normalized, so the block returns ``(x, None)``: with no
    residual pending, ``hidden`` is the whole stream. Each add + dropout + norm is one fused kernel call. A
    pending residual handed in (residual not None) is added first, as a pre-norm block would."""

    def __init__(self, *, attn: nn.Module, norm1: nn.Module, mlp: nn.Module, norm2: nn.Module,
                 input_dropout_p: float, residual_dropout_p: float):
        super().__init__()
        self.attn, self.norm1, self.mlp, self.norm2 = attn, norm1, mlp, norm2
        self.input_dropout_p, self.residual_dropout_p = input_dropout_p, residual_dropout_p

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, **attn_kwargs):
        x = F.dropout(hidden, self.input_dropout_p, self.training) if self.input_dropout_p > 0 else hidden
        if residual is not None:
            x = x + residual
        x = self.norm1(self.attn(x, **attn_kwargs), x, dropout_p=self.residual_dropout_p)
        x = self.norm2(self.mlp(x), x, dropout_p=self.residual_dropout_p)
        return x, None
