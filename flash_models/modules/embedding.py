"""Token embeddings, with an optional learned absolute position table (GPT-2, OPT, BERT), token types (BERT)
and a projection from a narrower token embedding up to the hidden size (OPT's project_in)."""

from __future__ import annotations

import torch
from torch import nn

import flash_kernels
from flash_kernels._backend import check_ids_in_range

from .norm import Norm
from .scaled_embedding import ScaledEmbedding
from .vocab_padding import hide_vocab_padding, padded_vocab_size, zero_vocab_padding


def _table(rows: int, dim: int, padding_idx: int | None = None, scale: float | None = None) -> nn.Embedding:
    """``nn.Embedding(rows, dim)`` (a ``ScaledEmbedding`` with ``scale``); on the meta device (a model built for
    loading) without its N(0, 1) init, which means nothing there and whose meta implementation imports
    torch._dynamo (seconds of a program's start, for nothing)."""
    kwargs = dict(padding_idx=padding_idx)
    if torch.empty(0).is_meta:  # the device the surrounding ``torch.device`` context creates tensors on
        kwargs["_weight"] = torch.empty(rows, dim)
    return nn.Embedding(rows, dim, **kwargs) if scale is None else ScaledEmbedding(rows, dim, scale=scale, **kwargs)


class Embeddings(nn.Module):
    """hidden = project_in(tokens(ids)) + positions(position_ids + position_offset) + token_types(type_ids), with
    ``tokens(ids)`` scaled by ``token_scale`` where given (Gemma: sqrt(hidden_size); see ``ScaledEmbedding``)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, max_positions: int | None = None, padding_idx: int | None = None,
        token_dim: int | None = None, position_offset: int = 0, type_vocab_size: int | None = None,
        vocab_multiple: int = 1, token_scale: float | None = None,
    ):
        """``vocab_multiple``: the token table holds rows up to that multiple (modules/vocab_padding.py), which
        state dicts never show; ids are checked against the real ``vocab_size``."""
        super().__init__()
        token_dim = token_dim or hidden_size
        self.vocab_size = vocab_size
        if padding_idx is not None and padding_idx < 0:  # from the end of the real vocabulary, not of the padded table
            padding_idx += vocab_size
        self.tokens = _table(padded_vocab_size(vocab_size, vocab_multiple), token_dim, padding_idx=padding_idx,
                             scale=token_scale)
        if self.tokens.num_embeddings != vocab_size:
            zero_vocab_padding(self.tokens, vocab_size)
            hide_vocab_padding(self.tokens, vocab_size)
        self.project_in = nn.Linear(token_dim, hidden_size, bias=False) if token_dim != hidden_size else None
        self.position_offset = position_offset
        self.positions = _table(max_positions + position_offset, hidden_size) if max_positions is not None else None
        self.token_types = _table(type_vocab_size, hidden_size) if type_vocab_size else None

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

    def check_ids(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, *, static_input: bool = False) -> None:
        """Token ids within the vocabulary, token types and positions within their tables (see
        ``check_ids_in_range``, also for ``static_input``)."""
        vocab = self.vocab_size
        check_ids_in_range(input_ids, vocab, message=f"input_ids must lie in [0, {vocab}): check the tokenizer matches the model",
                           static_input=static_input)
        for name, ids, table, offset in (("token_type_ids", token_type_ids, self.token_types, 0),
                                         ("position_ids", position_ids, self.positions, self.position_offset)):
            if ids is None or table is None:
                continue
            if ids.shape != input_ids.shape:
                raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(ids.shape)}")
            rows = table.num_embeddings - offset
            check_ids_in_range(ids, rows, message=f"{name} must lie in [0, {rows})", static_input=static_input)

    def normalized(self, norm: Norm, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                   token_type_ids: torch.Tensor | None = None, *, check_ids: bool = True) -> torch.Tensor:
        """``norm(self(input_ids, position_ids, token_type_ids))`` (BERT's embedding LayerNorm). Where nothing
        records gradients, on CUDA, it is one kernel (``flash_kernels.embedding_layer_norm``, the same bits)."""
        if not self._fusable(norm, input_ids, position_ids, token_type_ids):
            return norm(self(input_ids, position_ids, token_type_ids, check_ids=check_ids))
        if check_ids:
            self.check_ids(input_ids, token_type_ids)  # the kernel's wrapper checks the positions
        return flash_kernels.embedding_layer_norm(
            input_ids, self.tokens.weight, norm.weight, norm.bias, position_ids=position_ids,
            position_table=None if self.positions is None else self.positions.weight,
            position_offset=self.position_offset, token_type_ids=token_type_ids,
            type_table=None if self.token_types is None else self.token_types.weight, eps=norm.eps,
            backend=norm.kernel_backend, check_token_ids=False)

    def _fusable(self, norm: Norm, input_ids, position_ids, token_type_ids) -> bool:
        return (not torch.is_grad_enabled() and input_ids.is_cuda and norm.kind == "layer_norm" and not norm.zero_centered
                and type(self.tokens) is nn.Embedding
                and norm.kernel_backend != "reference" and self.project_in is None
                and (self.positions is None or position_ids is not None)
                and (self.token_types is None or token_type_ids is not None))
