"""BERT's task heads on a BertModel: masked LM, pretraining (MLM + next sentence), sequence and token
classification, extractive question answering. The checkpoint's ``architectures`` picks the class (exact
lookup), BertModel for none."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from flash_kernels._backend import holds_integers

from ...config import activation_name
from ...modules import Norm
from ...modules.mlp import activation
from ...modules.vocab_padding import resized_table
from ..hf_protocol import public_forward
from ..losses import classification_loss, cross_entropy
from ..outputs import HeadOutput
from .config import ARCHITECTURES, BertConfig
from .model import BertModel, BertPreTrainedModel

log = logging.getLogger(__name__)


class MaskedLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> decoder.

    Tied (the usual case): the decoder is the word embeddings plus ``bias`` (HF's ``cls.predictions.bias``, which
    HF ties to ``decoder.bias``). Untied, transformers unties every weight, the bias included: the decoder is a
    Linear with its own weight and bias, and ``bias`` is a parameter HF keeps but never uses; it stays here so
    both layouts load and save key for key."""

    def __init__(self, config: BertConfig, *, kernel_backend: str):
        super().__init__()
        self.activation, self.kernel_backend = activation_name(config.hidden_act), kernel_backend
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = Norm(config.hidden_size, kind="layer_norm", eps=config.layer_norm_eps, kernel_backend=kernel_backend)
        self.decoder = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def resize(self, old: int, new: int, *, mean_resizing: bool, std: float) -> None:
        """``resize_token_embeddings``' part here: new bias entries zero, as HF's; an untied decoder as the table."""
        kept = min(old, new)
        with torch.no_grad():
            bias = self.bias.new_zeros(new)
            bias[:kept] = self.bias[:kept]
        self.bias = nn.Parameter(bias, requires_grad=self.bias.requires_grad)
        if self.decoder is not None:
            self.decoder = resized_table(self.decoder, old, new, multiple=1, mean_resizing=mean_resizing, std=std)

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(activation(self.dense(hidden), self.activation, backend=self.kernel_backend))
        if self.decoder is None:
            return F.linear(hidden, word_embeddings, self.bias)
        return self.decoder(hidden)


class _BertWithHead(BertPreTrainedModel):
    """self.bert plus the head each subclass adds in ``head()``; weights initialized once everything exists."""

    pooler = False

    def __init__(self, config: BertConfig, *, attn_impl: str = "auto", kernel_backend: str = "auto"):
        super().__init__()
        self._setup(config, attn_impl, kernel_backend)
        self.bert = BertModel(config, attn_impl=attn_impl, kernel_backend=kernel_backend, add_pooling_layer=self.pooler)
        self.head(config)
        self.init_weights()

    def init_weights(self) -> None:
        super().init_weights()
        for module in self.modules():
            if isinstance(module, MaskedLMHead):  # HF zeroes the MLM output bias
                nn.init.zeros_(module.bias)

    @classmethod
    def from_pretrained(cls, path, *, num_labels: int | None = None, id2label: dict | None = None,
                        label2id: dict | None = None, problem_type: str | None = None, **kwargs):
        """HF's ``AutoModelFor<Task>.from_pretrained(path, num_labels=N)``: any BERT checkpoint (a ``BertModel``
        such as all-MiniLM, or another head) as this head (``on_encoder``). The labels as HF's config takes them:
        ``num_labels``, or their names ``id2label`` ({id: name}) / ``label2id`` ({name: id}); ``problem_type``
        picks the loss (None: the checkpoint's). ``kwargs`` as ``flash_models.from_pretrained``."""
        base = BertPreTrainedModel.from_pretrained(path, **kwargs)  # whichever BERT class the checkpoint names
        return cls.on_encoder(base, labels=label_names(num_labels, id2label, label2id), problem_type=problem_type)

    @classmethod
    def on_encoder(cls, base: BertPreTrainedModel, *, num_labels: int | None = None,
                   labels: tuple[str, ...] | None = None, problem_type: str | None = None) -> _BertWithHead:
        """This head on ``base``'s encoder (and pooler) weights, the head freshly initialised; ``base`` itself when
        it already is this head with as many labels (``num_labels``, or the names in ``labels``; its own when
        None), then only given the new names and ``problem_type`` (if not None). A pooler this head lacks is dropped;
        one it needs and the checkpoint lacks starts from random init (logged), as in HF."""
        if labels is None:  # as HF's config: the checkpoint's names while the count stays
            own = base.config.typed.labels
            labels = own if num_labels in (None, len(own)) else tuple(f"LABEL_{i}" for i in range(num_labels))
        elif num_labels is not None and num_labels != len(labels):
            raise ValueError(f"num_labels={num_labels} but {len(labels)} label names given; give one of them")
        config = dataclasses.replace(base.config.typed, architecture=cls.__name__, labels=labels,
                                     problem_type=problem_type or base.config.typed.problem_type)
        if type(base) is cls and len(labels) == base.config.num_labels:
            base.config.replace_typed(config)  # the same head: only its label names or loss change
            return base
        encoder = base if isinstance(base, BertModel) else base.bert
        reference = next(encoder.parameters())
        model = cls(config, attn_impl=encoder.attn_impl, kernel_backend=encoder.kernel_backend)
        state = {k: v for k, v in encoder.state_dict().items() if cls.pooler or not k.startswith("pooler.")}
        missing, unexpected = model.bert.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("pooler.") for k in missing):
            raise ValueError(f"the BERT checkpoint does not fit {cls.__name__}'s encoder: missing {missing}, "
                             f"unexpected {unexpected}")
        if missing:
            log.warning("the checkpoint has no pooler weights: the pooler starts from random init")
        return model.to(device=reference.device, dtype=reference.dtype).train(base.training)

    def resize_head(self, old: int, new: int, *, mean_resizing: bool, std: float) -> None:
        for head in [m for m in self.modules() if isinstance(m, MaskedLMHead)]:
            head.resize(old, new, mean_resizing=mean_resizing, std=std)

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

    @public_forward
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

    @public_forward
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

    @public_forward
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

    @public_forward
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None, *,
                cu_seqlens=None, max_seqlen=None) -> HeadOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen).last_hidden_state
        logits = self.classifier(self.classifier_dropout(hidden))  # (B, S, num_labels), or (1, total, ...) packed
        loss = cross_entropy(logits, labels) if labels is not None else None
        return HeadOutput(logits=logits, loss=loss, last_hidden_state=hidden)


class BertForQuestionAnswering(_BertWithHead):
    """Extractive QA (HF's head): per token, the logits that the answer span starts and ends there.

    The loss, as HF's, is a softmax over every position of the row, padding included. Padding rows are what
    the backend makes of them: the same as HF's on the eager and sdpa paths, zero on the flash path (a padded
    batch is unpadded), so there a padded batch's loss differs from HF's while its real tokens' logits agree."""

    def head(self, config):
        if config.num_labels != 2:
            raise ValueError(f"BertForQuestionAnswering scores a span's start and end: num_labels must be 2, got "
                             f"{config.num_labels}")
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    @classmethod
    def on_encoder(cls, base: BertPreTrainedModel, *, num_labels: int | None = None,
                   labels: tuple[str, ...] | None = None, problem_type: str | None = None) -> _BertWithHead:
        """As the other heads', with two labels (start, end) whatever ``base``'s own count."""
        if num_labels is None and labels is None:
            num_labels = 2
        return super().on_encoder(base, num_labels=num_labels, labels=labels, problem_type=problem_type)

    @public_forward
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, start_positions=None,
                end_positions=None, *, cu_seqlens=None, max_seqlen=None) -> HeadOutput:
        scored = start_positions is not None and end_positions is not None  # HF: a loss only when both are given
        if scored and cu_seqlens is not None:
            raise ValueError("start_positions/end_positions need a padded batch (B, S), not a packed one "
                             "(cu_seqlens): a position counts within its own row")
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen).last_hidden_state
        start_logits, end_logits = self.qa_outputs(hidden).unbind(-1)  # (B, S) each
        loss = None
        if scored:  # the mean of the two ends' losses
            loss = (span_loss(start_logits, start_positions, "start_positions")
                    + span_loss(end_logits, end_positions, "end_positions")) / 2
        return HeadOutput(start_logits=start_logits.contiguous(), end_logits=end_logits.contiguous(), loss=loss,
                          last_hidden_state=hidden)


def span_loss(logits: torch.Tensor, positions: torch.Tensor, name: str) -> torch.Tensor:
    """HF's QA loss for one end of the span: cross-entropy over the row's tokens, a position outside the row
    (clamped to S) ignored, as an answer truncated out of its window is."""
    if not holds_integers(positions):
        raise ValueError(f"{name} must be integer token indices, got a tensor of {positions.dtype}")
    if positions.dim() > 1:
        positions = positions.squeeze(-1)
    if positions.shape != logits.shape[:1]:
        raise ValueError(f"{name} must hold one token index per row, shape ({logits.shape[0]},), got "
                         f"{tuple(positions.shape)}")
    seq_len = logits.shape[1]
    return F.cross_entropy(logits.float(), positions.clamp(0, seq_len).long(), ignore_index=seq_len)


def label_names(num_labels: int | None, id2label: dict | None, label2id: dict | None) -> tuple[str, ...] | None:
    """The label names, in id order, that HF's ``num_labels`` / ``id2label`` / ``label2id`` describe (None: the
    checkpoint's own). Ids must run 0..N-1, as HF's heads number their outputs."""
    if id2label is None and label2id is not None:
        id2label = {i: name for name, i in label2id.items()}
    if id2label is None:
        return None if num_labels is None else tuple(f"LABEL_{i}" for i in range(num_labels))
    ids = sorted(int(i) for i in id2label)  # a config.json's keys are strings
    if ids != list(range(len(ids))):
        raise ValueError(f"id2label/label2id ids must be 0..{len(ids) - 1}, got {ids}")
    names = {int(i): name for i, name in id2label.items()}
    if label2id is not None and {name: int(i) for name, i in label2id.items()} != {n: i for i, n in names.items()}:
        raise ValueError("label2id is not the inverse of id2label; give one of them")
    if num_labels is not None and num_labels != len(ids):
        raise ValueError(f"num_labels={num_labels} but {len(ids)} labels in id2label/label2id; give one of them")
    return tuple(names[i] for i in ids)


CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (BertModel, BertForPreTraining, BertForMaskedLM, BertForSequenceClassification,
                BertForTokenClassification, BertForQuestionAnswering)
}
assert tuple(CLASSES) == ARCHITECTURES


def build_bert(config: BertConfig, *, attn_impl: str = "auto", kernel_backend: str = "auto") -> nn.Module:
    """The class the config's architecture names (``from_pretrained`` of a base checkpoint gives BertModel)."""
    return CLASSES[config.architecture](config, attn_impl=attn_impl, kernel_backend=kernel_backend)
