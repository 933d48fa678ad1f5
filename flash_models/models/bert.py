"""BERT (HF ``model_type`` "bert"): absolute positions and token types, post-norm blocks, a tanh pooler, and
the task heads. The checkpoint's ``architectures`` picks the class (exact lookup): BertModel (also for none),
BertForPreTraining, BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification.

On the flash path a padded batch is unpadded once, before the embeddings: every layer runs on the packed real
tokens with varlen attention, and the output is scattered back to (B, S) at the end (padding rows are zero).
The other backends keep the (B, S) layout and mask padded keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from ..config import AttentionConfig, MLPConfig, check_choice
from ..modules import MLP, Attention, Embeddings, Norm, PostNormBlock, build_attention_mask
from ..modules.cuda_graphs import replays_graph
from ..modules.mlp import activation
from ..modules.encoder_graphs import GraphedEncoder
from ..modules.padding import PackedBatch, positions_in_documents
from ..registry import Family, Preset, register_family, register_preset
from .common import PROBLEM_TYPES, EncoderOutput, HeadOutput, PretrainedModel, classification_loss, cross_entropy


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | None = None
    tie_word_embeddings: bool = True
    architecture: str = "BertModel"  # HF ``architectures[0]``: which head class
    labels: tuple[str, ...] = ("LABEL_0", "LABEL_1")  # HF id2label, in id order
    problem_type: str | None = None

    model_type = "bert"
    _PLAIN = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
        "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout", "tie_word_embeddings", "problem_type",
    )

    def __post_init__(self):
        check_choice("architecture", self.architecture, tuple(ARCHITECTURES))
        check_choice("problem_type", self.problem_type, PROBLEM_TYPES)

    @classmethod
    def from_hf(cls, hf: transformers.BertConfig) -> BertConfig:
        if hf.is_decoder or hf.add_cross_attention:
            raise ValueError("BERT as a decoder (is_decoder / add_cross_attention) is not supported")
        position_type = hf.to_dict().get("position_embedding_type", "absolute")  # a field older configs carry
        if position_type != "absolute":
            raise ValueError(f"BERT position_embedding_type={position_type!r} is not supported; only 'absolute'")
        architecture = hf.architectures[0] if hf.architectures else "BertModel"
        if architecture not in ARCHITECTURES:
            raise ValueError(f"BERT architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}")
        return cls(**{name: getattr(hf, name) for name in cls._PLAIN}, architecture=architecture,
                   labels=tuple(hf.id2label[i] for i in range(hf.num_labels)))

    def to_hf(self) -> transformers.BertConfig:
        hf = transformers.BertConfig(**{name: getattr(self, name) for name in self._PLAIN},
                                     id2label=dict(enumerate(self.labels)))
        hf.architectures = [self.architecture]
        return hf

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def attention(self) -> AttentionConfig:
        h, heads = self.hidden_size, self.num_attention_heads
        if h % heads:
            raise ValueError(f"hidden_size {h} is not a multiple of num_attention_heads {heads}")
        return AttentionConfig(hidden_size=h, num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
                               dropout_p=self.attention_probs_dropout_prob, causal=False)


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
            if isinstance(module, MaskedLMHead):
                nn.init.zeros_(module.bias)


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
        if cu_seqlens is not None:
            return self._forward_packed(input_ids, token_type_ids, position_ids, attention_mask, cu_seqlens, max_seqlen)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        limit = self.config.max_position_embeddings
        if S > limit:
            raise ValueError(f"sequence of {S} tokens exceeds BERT's {limit} positions; truncate the input")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
            raise ValueError(f"token_type_ids shape {tuple(token_type_ids.shape)} != input_ids {tuple(input_ids.shape)}")
        flash = attention_mask is not None and self.blocks[0].attn.backend_for(self.embed.tokens.weight) == "flash"
        if flash and replays_graph(self, self.graphed, input_ids):
            # Packed, checked, encoded inside the graph, which also makes the default positions and types.
            hidden = self.graphed(input_ids, position_ids, token_type_ids, attention_mask)
            return EncoderOutput(last_hidden_state=hidden, pooler_output=self._pool(hidden[:, 0]))
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if not flash:
            mask = build_attention_mask(attention_mask, q_len=S, past_len=0, causal=False, sliding_window=None)
            hidden = self._encode(input_ids, position_ids, token_type_ids, mask)
        else:  # every layer runs on the real tokens only
            packed = PackedBatch.from_mask(attention_mask)
            input_ids, position_ids, token_type_ids = (packed.pack(t) for t in (input_ids, position_ids, token_type_ids))
            mask = build_attention_mask(None, q_len=packed.total, past_len=0, causal=False, sliding_window=None,
                                        cu_seqlens=packed.cu_seqlens)
            hidden = packed.unpack(self._encode(input_ids, position_ids, token_type_ids, mask))
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
        ``modules.encoder_graphs``. The first batch of a new bucket captures its graph. Graphs read the
        weights where they were at capture; moving the model (``.to``, ``.half``) drops them, to be captured again."""
        check = lambda ids, positions, types: self.embed.check_ids(ids, types, positions, static_input=True)  # noqa: E731
        self.graphed = GraphedEncoder(self._encode, self, seq_limit=self.config.max_position_embeddings,
                                      check=check, max_graphs=max_graphs) if enabled else None
        return self


class MaskedLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> decoder (tied to the word embeddings unless untied) + bias."""

    def __init__(self, config: BertConfig, *, kernel_backend: str):
        super().__init__()
        self.activation, self.kernel_backend = config.hidden_act, kernel_backend
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = Norm(config.hidden_size, kind="layer_norm", eps=config.layer_norm_eps, kernel_backend=kernel_backend)
        self.decoder = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(activation(self.dense(hidden), self.activation, backend=self.kernel_backend))
        weight = word_embeddings if self.decoder is None else self.decoder.weight
        return F.linear(hidden, weight, self.bias)


class _BertWithHead(BertPreTrainedModel):
    """self.bert plus the head each subclass adds in ``head()``; weights initialized once everything exists."""

    pooler = False

    def __init__(self, config: BertConfig, *, attn_impl: str = "auto", kernel_backend: str = "auto"):
        super().__init__()
        self._setup(config, attn_impl, kernel_backend)
        self.bert = BertModel(config, attn_impl=attn_impl, kernel_backend=kernel_backend, add_pooling_layer=self.pooler)
        self.head(config)
        self.init_weights()

    def use_cuda_graphs(self, enabled: bool = True, *, max_graphs: int = 16):
        """The encoder's ``BertModel.use_cuda_graphs``; the head runs eagerly after it."""
        self.bert.use_cuda_graphs(enabled, max_graphs=max_graphs)
        return self

    @staticmethod
    def labelled_sequences(logits: torch.Tensor, labels: torch.Tensor, packed: bool) -> torch.Tensor:
        """The per-sequence logits that ``labels`` covers. A packed batch may carry more sequences than labels
        (the padding sequences of a CUDA-graph bucket come last): its first len(labels) sequences are scored."""
        if not packed:
            return logits
        if labels.shape[0] > logits.shape[0]:
            raise ValueError(f"{labels.shape[0]} labels for a packed batch of {logits.shape[0]} sequences")
        return logits[: labels.shape[0]]

    def classifier_dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.classifier_dropout if self.config.classifier_dropout is not None else self.config.hidden_dropout_prob
        return F.dropout(x, p, self.training)


class BertForMaskedLM(_BertWithHead):
    def head(self, config):
        self.mlm = MaskedLMHead(config, kernel_backend=self.kernel_backend)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None, *,
                cu_seqlens=None, max_seqlen=None) -> HeadOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen).last_hidden_state
        logits = self.mlm(hidden, self.bert.embed.tokens.weight)
        loss = cross_entropy(logits, labels) if labels is not None else None
        return HeadOutput(logits=logits, loss=loss, last_hidden_state=hidden)


class BertForPreTraining(_BertWithHead):
    pooler = True

    def head(self, config):
        self.mlm = MaskedLMHead(config, kernel_backend=self.kernel_backend)
        self.nsp = nn.Linear(config.hidden_size, 2)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                next_sentence_label=None, *, cu_seqlens=None, max_seqlen=None) -> HeadOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen)
        mlm_logits = self.mlm(out.last_hidden_state, self.bert.embed.tokens.weight)
        nsp_logits = self.nsp(out.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:  # HF: the sum, only when both are given
            nsp = self.labelled_sequences(nsp_logits, next_sentence_label, cu_seqlens is not None)
            loss = cross_entropy(mlm_logits, labels) + cross_entropy(nsp, next_sentence_label)
        return HeadOutput(prediction_logits=mlm_logits, seq_relationship_logits=nsp_logits, loss=loss,
                          last_hidden_state=out.last_hidden_state)


class BertForSequenceClassification(_BertWithHead):
    pooler = True

    def head(self, config):
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None, *,
                cu_seqlens=None, max_seqlen=None) -> HeadOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen)
        logits = self.classifier(self.classifier_dropout(out.pooler_output))  # (B or N sequences, num_labels)
        loss = None
        if labels is not None:
            scored = self.labelled_sequences(logits, labels, cu_seqlens is not None)
            loss = classification_loss(scored, labels, problem_type=self.config.problem_type)
        return HeadOutput(logits=logits, loss=loss, last_hidden_state=out.last_hidden_state)


class BertForTokenClassification(_BertWithHead):
    def head(self, config):
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None, *,
                cu_seqlens=None, max_seqlen=None) -> HeadOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen).last_hidden_state
        logits = self.classifier(self.classifier_dropout(hidden))  # (B, S, num_labels), or (1, total, ...) packed
        loss = cross_entropy(logits, labels) if labels is not None else None
        return HeadOutput(logits=logits, loss=loss, last_hidden_state=hidden)


ARCHITECTURES: dict[str, type] = {
    cls.__name__: cls
    for cls in (BertModel, BertForPreTraining, BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification)
}


def build_bert(config: BertConfig, *, attn_impl: str = "auto", kernel_backend: str = "auto") -> nn.Module:
    """The class the config's architecture names (``from_pretrained`` of a base checkpoint gives BertModel)."""
    return ARCHITECTURES[config.architecture](config, attn_impl=attn_impl, kernel_backend=kernel_backend)


register_family(Family("bert", BertConfig, build_bert, hf_auto_class="AutoModel"))
register_preset(Preset("bert-base", "bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
                       description="BERT-base shape: 12 layers, hidden 768"))
register_preset(Preset("bert-large", "bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
                       description="BERT-large shape: 24 layers, hidden 1024"))
