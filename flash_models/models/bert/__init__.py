"""BERT (HF ``model_type`` "bert"): the encoder (model.py), its task heads (heads.py), config and checkpoint
rules. The checkpoint's ``architectures`` picks the class (exact lookup): BertModel (also for none),
BertForPreTraining, BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification,
BertForQuestionAnswering."""

from ..family import Family, Preset
from .config import BertConfig
from .heads import (
    BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
    BertForTokenClassification, build_bert,
)
from .model import BertModel
from .rules import bert_rules

__all__ = [
    "BertConfig", "BertForMaskedLM", "BertForPreTraining", "BertForQuestionAnswering", "BertForSequenceClassification",
    "BertForTokenClassification", "BertModel",
]


def bert_tiny(preset: dict) -> dict:
    return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128,
                max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


FAMILY = Family(
    config_class=BertConfig, model_class=build_bert, rules=bert_rules, tiny=bert_tiny, hf_auto_class="AutoModel",
    presets=(
        Preset("bert-base", "bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
               description="BERT-base shape: 12 layers, hidden 768"),
        Preset("bert-large", "bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
               description="BERT-large shape: 24 layers, hidden 1024"),
    ),
)
