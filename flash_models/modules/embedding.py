"""Token embeddings, with an optional learned absolute position table (GPT-2, OPT, BERT), token types (BERT)
and a projection from a narrower token embedding up to the hidden size (OPT's project_in)."""

from __future__ import annotations

import torch
from torch import nn

from flash_kernels._backend import check_ids_in_range


class Embeddings(nn.Module):
    """hidden = project_in(tokens(ids)) + positions(position_ids + position_offset) + token_types(type_ids)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, max_positions: int | None = None, padding_idx: int | None = None,
        token_dim: int | None = None, position_offset: int = 0, type_vocab_size: int | None = None,
    ):
        super().__init__()
        token_dim = token_dim or hidden_size
        self.tokens = nn.Embedding(vocab_size, token_dim, padding_idx=padding_idx)
        self.project_in = nn.Linear(token_dim, hidden_size, bias=False) if token_dim != hidden_size else None
        self.position_offset = position_offset
        self.positions = nn.Embedding(max_positions + position_offset, hidden_size) if max_positions is not None else None
        self.token_types = nn.Embedding(type_vocab_size, hidden_size) if type_vocab_size else None

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
        *, check_ids: bool = True,
    ) -> torch.Tensor:
        """``check_ids=False`` skips the id checks, for ids the library made itself (sampled tokens) or has
        checked already with ``Embeddings.check_ids``."""
        if check_ids:
            self.check_ids(input_ids, token_type_ids)
        hidden = self.tokens(input_ids)  # (B, S, token_dim)
        if self.project_in is not None:
            hidden = self.project_in(hidden)  # (B, S, hidden)
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids + self.position_offset if self.position_offset else position_ids)
        if self.token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            hidden = hidden + self.token_types(token_type_ids)
        return hidden

    def check_ids(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None, *,
                  static_input: bool = False) -> None:
        """Token ids within the vocabulary and token types within their table (see ``check_ids_in_range``,
        also for ``static_input``)."""
        vocab = self.tokens.num_embeddings
        check_ids_in_range(input_ids, vocab, message=f"input_ids must lie in [0, {vocab}): check the tokenizer matches the model",
                           static_input=static_input)
        if token_type_ids is None or self.token_types is None:
            return
        if token_type_ids.shape != input_ids.shape:
            raise ValueError(
                f"token_type_ids must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(token_type_ids.shape)}"
            )
        types = self.token_types.num_embeddings
        check_ids_in_range(token_type_ids, types, message=f"token_type_ids must lie in [0, {types})",
                           static_input=static_input)
