"""BERT's checkpoint rules (HF layout <-> ours), per head class."""

from __future__ import annotations

from ..checkpoint_rules import Rule, RuleSet, fused_qkv, pairs
from .config import BertConfig

_BERT_LEGACY = ((r"LayerNorm\.gamma$", "LayerNorm.weight"), (r"LayerNorm\.beta$", "LayerNorm.bias"))


def bert_rules(config: BertConfig) -> RuleSet:
    """BertModel checkpoints carry no prefix; the head classes nest it under ``bert.``, as in HF."""
    base = config.architecture == "BertModel"
    o, p = ("", "") if base else ("bert.", "bert.")
    layer = f"{p}encoder.layer.{{layer}}."
    block = f"{o}blocks.{{layer}}."
    rules = [
        Rule(f"{o}embed.tokens.weight", f"{p}embeddings.word_embeddings.weight"),
        Rule(f"{o}embed.positions.weight", f"{p}embeddings.position_embeddings.weight"),
        Rule(f"{o}embed.token_types.weight", f"{p}embeddings.token_type_embeddings.weight"),
        *pairs(f"{o}embed_norm", f"{p}embeddings.LayerNorm"),
        *fused_qkv(f"{block}attn.qkv", tuple(f"{layer}attention.self.{n}" for n in ("query", "key", "value")), config.hidden_size),
        *pairs(f"{block}attn.out_proj", f"{layer}attention.output.dense"),
        *pairs(f"{block}norm1", f"{layer}attention.output.LayerNorm"),
        *pairs(f"{block}mlp.fc1", f"{layer}intermediate.dense"),
        *pairs(f"{block}mlp.fc2", f"{layer}output.dense"),
        *pairs(f"{block}norm2", f"{layer}output.LayerNorm"),
    ]
    ignore = [(r"bert\." if p else "") + r"embeddings\.(position_ids|token_type_ids)"]  # buffers of older versions
    with_pooler = config.architecture in ("BertModel", "BertForPreTraining", "BertForSequenceClassification")
    fresh = []
    if with_pooler:
        rules += pairs(f"{o}pooler", f"{p}pooler.dense")
        fresh.append((r"bert\." if p else "") + r"pooler\.dense\.(weight|bias)")  # BertModel(add_pooling_layer=False)'s
    else:
        ignore.append(r"bert\.pooler\..*")  # pretraining checkpoints loaded for MLM or tagging carry one
    if config.architecture in ("BertForPreTraining", "BertForMaskedLM"):
        rules += [*pairs("mlm.dense", "cls.predictions.transform.dense"),
                  *pairs("mlm.norm", "cls.predictions.transform.LayerNorm"),
                  Rule("mlm.bias", "cls.predictions.bias")]
        if config.tie_word_embeddings:  # the decoder is the word embeddings and cls.predictions.bias
            ignore.append(r"cls\.predictions\.decoder\.(weight|bias)")
        else:  # transformers unties the bias too (heads.MaskedLMHead)
            rules += pairs("mlm.decoder", "cls.predictions.decoder")
    if config.architecture == "BertForPreTraining":
        rules += pairs("nsp", "cls.seq_relationship")
    elif config.architecture == "BertForMaskedLM":
        ignore.append(r"cls\.seq_relationship\..*")  # the NSP head of a pretraining checkpoint
    if config.architecture in ("BertForSequenceClassification", "BertForTokenClassification"):
        rules += pairs("classifier", "classifier")
    if config.architecture == "BertForQuestionAnswering":
        rules += pairs("qa_outputs", "qa_outputs")
    return RuleSet(tuple(rules), ignore=tuple(ignore), fresh=tuple(fresh), legacy_keys=_BERT_LEGACY)
