"""BertModel: absolute positions and token types, post-norm blocks, a tanh pooler.

On the flash path a padded batch is unpadded once, before the embeddings: every layer runs on the packed real
tokens with varlen attention, and the output is scattered back to (B, S) at the end (padding rows are zero).
The other backends keep the (B, S) layout and mask padded keys."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from flash_kernels._backend import check_ids_in_range

from ...config import MLPConfig
from ...modules import MLP, Attention, Embeddings, Norm, PostNormBlock, build_attention_mask
from ...modules.attention import without_padding
from ...runtime.cuda_graphs import replays_graph
from ...runtime.encoder_graphs import GraphedEncoder
from ...modules.varlen import UnpaddedBatch, positions_in_documents
from ...modules.vocab_padding import resized_table, resized_vocab_size
from ..hf_protocol import public_forward
from ..outputs import EncoderOutput
from ..pretrained import PretrainedModel
from .config import BertConfig


class BertPreTrainedModel(PretrainedModel):
    def init_weights(self) -> None:
        """BERT practice: N(0, initializer_range) for linears and embeddings, zero biases, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, Norm):
                module.reset_parameters()

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """HF's method (tokens added to the tokenizer): the vocabulary becomes ``new_num_tokens`` ids (rounded up
        to ``pad_to_multiple_of``), in place. The first ids keep their rows; new rows start at the old rows' mean
        (``mean_resizing``) or from the model's init. A masked-LM head follows: its output bias gets zeros, an
        untied decoder new rows as the table. ``config.vocab_size`` follows. Returns the token table."""
        old = self.config.vocab_size
        new = resized_vocab_size(old, new_num_tokens, pad_to_multiple_of)
        encoder = self if isinstance(self, BertModel) else self.bert
        if new != old:
            typed = dataclasses.replace(self.config.typed, vocab_size=new)  # checks the pad_token_id still fits
            std = typed.initializer_range
            encoder.embed.tokens = resized_table(encoder.embed.tokens, old, new, multiple=1,
                                                 mean_resizing=mean_resizing, std=std)
            encoder.embed.vocab_size = new
            self.resize_head(old, new, mean_resizing=mean_resizing, std=std)
            for model in {id(self): self, id(encoder): encoder}.values():
                model.config.replace_typed(dataclasses.replace(model.config.typed, vocab_size=new))
        return self.get_input_embeddings()

    def resize_head(self, old: int, new: int, *, mean_resizing: bool, std: float) -> None:
        """A head's part of ``resize_token_embeddings``: nothing for heads without vocabulary outputs."""


class BertModel(BertPreTrainedModel):
    def __init__(self, config: BertConfig, *, attn_impl: str = "auto", kernel_backend: str = "auto",
                 add_pooling_layer: bool = True):
        super().__init__()
        self._setup(config, attn_impl, kernel_backend)
        c = config

        def norm() -> Norm:
            return Norm(c.hidden_size, kind="layer_norm", eps=c.layer_norm_eps, kernel_backend=kernel_backend)

        self.embed = Embeddings(c.vocab_size, c.hidden_size, max_positions=c.max_position_embeddings,
                                type_vocab_size=c.type_vocab_size, padding_idx=c.pad_token_id)  # as HF: no gradient to the pad row
        self.embed_norm = norm()
        mlp = MLPConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, activation=c.hidden_act)
        self.blocks = nn.ModuleList(
            PostNormBlock(attn=Attention(c.attention(), layer_idx=i, attn_impl=attn_impl, kernel_backend=kernel_backend),
                          norm1=norm(),
                          mlp=MLP(mlp, kernel_backend=kernel_backend), norm2=norm(),
                          input_dropout_p=0.0, residual_dropout_p=c.hidden_dropout_prob)
            for i in range(c.num_hidden_layers)
        )
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size) if add_pooling_layer else None
        self.graphed: GraphedEncoder | None = None  # set by use_cuda_graphs()
        if type(self) is BertModel:
            self.init_weights()

    @public_forward
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> EncoderOutput:
        """input_ids (B, S); attention_mask (B, S), 1 = token, 0 = padding (left or right).

        Or a packed batch (FlashAttention's varlen convention): input_ids (1, total) holding N sequences back to
        back and ``cu_seqlens`` (N + 1,) int32 their offsets, ending at total (empty sequences allowed);
        position_ids restart at 0 in each sequence (derived when not given). ``max_seqlen``, an upper bound of
        the sequence lengths, spares the host read that would find it, so a CUDA graph can capture the call.
        Then last_hidden_state is (1, total, hidden) and pooler_output (N, hidden), from each sequence's first
        token (an empty sequence gets an arbitrary row: leave it out of any loss).
        """
        if position_ids is not None:  # the embedding checks ids and types; given positions would index unchecked
            limit = self.config.max_position_embeddings
            check_ids_in_range(position_ids, limit, message=f"position_ids must lie in [0, {limit}) (BERT's "
                               "max_position_embeddings); leave them out to count from 0 in each sequence")
        if cu_seqlens is not None:
            return self._forward_packed(input_ids, token_type_ids, position_ids, attention_mask, cu_seqlens, max_seqlen)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if S == 0:
            raise ValueError("input_ids is empty: give at least one token")
        limit = self.config.max_position_embeddings
        if S > limit:
            raise ValueError(f"sequence of {S} tokens exceeds BERT's {limit} positions; truncate the input")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
            raise ValueError(f"token_type_ids shape {tuple(token_type_ids.shape)} != input_ids {tuple(input_ids.shape)}")
        attn, weight = self.blocks[0].attn, self.embed.tokens.weight
        if attention_mask is not None and attn.backend_for(weight) == "flash" and replays_graph(self, self.graphed, input_ids):
            # Packed, checked, encoded inside the graph, which also makes the default positions and types.
            hidden = self.graphed(input_ids, position_ids, token_type_ids, attention_mask)
            return EncoderOutput(last_hidden_state=hidden, pooler_output=self._pool(hidden[:, 0]))
        attention_mask = without_padding(attention_mask)  # a batch without padding: no mask, nothing to unpad
        unpad = attention_mask is not None and attn.backend_computing(weight) == "flash"
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if unpad:  # every layer runs on the real tokens only
            unpadded = UnpaddedBatch.from_mask(attention_mask)
            input_ids, position_ids, token_type_ids = (unpadded.unpad(t) for t in (input_ids, position_ids, token_type_ids))
            mask = build_attention_mask(None, q_len=unpadded.total, past_len=0, causal=False, sliding_window=None,
                                        cu_seqlens=unpadded.cu_seqlens)
            hidden = unpadded.pad(self._encode(input_ids, position_ids, token_type_ids, mask))
        else:
            mask = build_attention_mask(attention_mask, q_len=S, past_len=0, causal=False, sliding_window=None)
            hidden = self._encode(input_ids, position_ids, token_type_ids, mask)
        return EncoderOutput(last_hidden_state=hidden, pooler_output=self._pool(hidden[:, 0]))

    def _forward_packed(self, input_ids, token_type_ids, position_ids, attention_mask, cu_seqlens, max_seqlen):
        if attention_mask is not None:
            raise ValueError("pass attention_mask (a padded batch) or cu_seqlens (a packed one), not both")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"with cu_seqlens, input_ids is one packed row (1, total), got {tuple(input_ids.shape)}")
        total, limit = input_ids.shape[1], self.config.max_position_embeddings
        if max_seqlen is not None and max_seqlen > limit:
            raise ValueError(f"max_seqlen={max_seqlen} exceeds BERT's {limit} positions; truncate the sequences")
        for name, t in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids {tuple(input_ids.shape)}")
        mask = build_attention_mask(None, q_len=total, past_len=0, causal=False, sliding_window=None,
                                    cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if mask.max_seqlen > limit:
            raise ValueError(f"a sequence of {mask.max_seqlen} tokens exceeds BERT's {limit} positions; truncate it")
        if position_ids is None:
            position_ids = positions_in_documents(cu_seqlens, total).unsqueeze(0)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self._encode(input_ids, position_ids, token_type_ids, mask)
        # Each sequence's first token; an empty one's offset may equal total, hence the clamp (no host read).
        first = cu_seqlens[:-1].clamp(max=max(total - 1, 0)).long()
        return EncoderOutput(last_hidden_state=hidden, pooler_output=self._pool(hidden[0, first]))

    def _pool(self, first_tokens: torch.Tensor) -> torch.Tensor | None:
        return torch.tanh(self.pooler(first_tokens)) if self.pooler is not None else None

    def _encode(self, input_ids, position_ids, token_type_ids, mask) -> torch.Tensor:
        """Embeddings and every block: (B, S) or packed (1, total) ids -> hidden states of the same layout."""
        hidden = self.embed.normalized(self.embed_norm, input_ids, position_ids, token_type_ids)
        hidden = F.dropout(hidden, self.config.hidden_dropout_prob, self.training)
        residual = None
        for block in self.blocks:
            hidden, residual = block(hidden, residual, mask=mask, position_ids=position_ids)
        return hidden

    def use_cuda_graphs(self, enabled: bool = True, *, max_graphs: int = 16) -> BertModel:
        """Inference on CUDA (eval mode, grad off, flash attention, an ``attention_mask``) replays the encoder
        from CUDA graphs, one per bucket of (rows, columns, packed tokens, sequences, longest sequence); see
        ``runtime.encoder_graphs``. The first batch of a new bucket captures its graph. Graphs read the
        weights where they were at capture; moving the model (``.to``, ``.half``) drops them, to be captured again."""
        check = lambda ids, positions, types: self.embed.check_ids(ids, types, positions, static_input=True)  # noqa: E731
        self.graphed = GraphedEncoder(self._encode, self, seq_limit=self.config.max_position_embeddings,
                                      check=check, max_graphs=max_graphs) if enabled else None
        return self
