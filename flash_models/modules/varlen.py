"""Rows of different lengths in one row, FlashAttention's varlen layout (int32 offsets ``cu_seqlens``), in the
two ways the models use it:

- an unpadded batch (``UnpaddedBatch``): the real tokens of a right- or left-padded batch gathered into one row
  and scattered back. BERT on the flash path unpads once before the embeddings and pads once at the end, so
  no layer spends work on padding;
- documents back to back (``positions_in_documents``): training rows that hold several documents, whose
  positions restart at each one.

"qkv-packed" elsewhere means something else: q, k and v in one projection's output (FlashAttention's name)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class UnpaddedBatch:
    index: torch.Tensor  # (total,) flat positions of the real tokens in the (B * S) batch
    cu_seqlens: torch.Tensor  # (B + 1,) int32 offsets of each batch row's tokens in the one row
    batch_size: int
    seq_len: int

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> UnpaddedBatch:
        """attention_mask (B, S): 1 for real tokens, 0 for padding."""
        counts = attention_mask.sum(1, dtype=torch.int32)
        return cls(index=attention_mask.flatten().nonzero().squeeze(1),
                   cu_seqlens=F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)),
                   batch_size=attention_mask.shape[0], seq_len=attention_mask.shape[1])

    @property
    def total(self) -> int:
        return self.index.numel()

    @property
    def max_seqlen(self) -> int:
        """The longest row's real tokens (one host read)."""
        return int(self.cu_seqlens.diff().max())

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (1, total, ...)."""
        return t.flatten(0, 1)[self.index].unsqueeze(0)

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """(1, total, ...) -> (B, S, ...), zeros at the padding."""
        out = t.new_zeros(self.batch_size * self.seq_len, *t.shape[2:])
        out[self.index] = t[0]
        return out.view(self.batch_size, self.seq_len, *t.shape[2:])


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each token of the row within its own document: (total,). No host read (``output_size``), so a
    CUDA graph can capture it."""
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), cu_seqlens.diff().long(), output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts
