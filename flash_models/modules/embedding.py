"""Token embeddings, with an optional learned absolute position table (GPT-2, OPT, BERT)."""

from __future__ import annotations

import torch
from torch import nn


class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, max_positions: int | None = None, padding_idx: int | None = None):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden_size, padding_idx=padding_idx)
        self.positions = nn.Embedding(max_positions, hidden_size) if max_positions is not None else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        vocab = self.tokens.num_embeddings
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"input_ids must lie in [0, {vocab}); got values in [{int(input_ids.min())}, {int(input_ids.max())}]")
        hidden = self.tokens(input_ids)  # (B, S, hidden)
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids)
        return hidden
