"""BERT's typed config (HF ``model_type`` "bert"): which head class a checkpoint needs is its ``architecture``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...config import AttentionConfig, check_choice, check_pad_token_id
from ..family import hf_class
from ..losses import PROBLEM_TYPES

if TYPE_CHECKING:
    import transformers

# HF ``architectures[0]`` names we build (heads.py holds the classes).
ARCHITECTURES = ("BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForSequenceClassification",
                 "BertForTokenClassification", "BertForQuestionAnswering")


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
    hf_config_class = "BertConfig"
    _PLAIN = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
        "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout", "tie_word_embeddings", "problem_type",
    )

    def __post_init__(self):
        check_choice("architecture", self.architecture, ARCHITECTURES)
        check_choice("problem_type", self.problem_type, PROBLEM_TYPES)
        check_pad_token_id(self.pad_token_id, self.vocab_size)

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
        hf = hf_class(self.hf_config_class)(**{name: getattr(self, name) for name in self._PLAIN},
                                     id2label=dict(enumerate(self.labels)),
                                     label2id={name: i for i, name in enumerate(self.labels)})
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
