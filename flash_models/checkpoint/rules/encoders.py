"""Checkpoint rules of the encoder (BERT) and vision (ViT) families: HF layouts, and timm's ViT layout."""

from __future__ import annotations

from ..remap import Rule, RuleSet, concat


def _pairs(ours: str, hf: str, *, bias: bool = True) -> list[Rule]:
    """weight (and bias) of one linear or norm."""
    return [Rule(f"{ours}.{w}", f"{hf}.{w}") for w in (("weight", "bias") if bias else ("weight",))]


def _qkv(ours: str, hf: tuple[str, str, str], hidden: int, *, bias: bool = True) -> list[Rule]:
    rules = [Rule(f"{ours}.weight", tuple(f"{p}.weight" for p in hf), concat((hidden,) * 3))]
    if bias:
        rules.append(Rule(f"{ours}.bias", tuple(f"{p}.bias" for p in hf), concat((hidden,) * 3)))
    return rules


_BERT_LEGACY = ((r"LayerNorm\.gamma$", "LayerNorm.weight"), (r"LayerNorm\.beta$", "LayerNorm.bias"))


def bert_rules(config) -> RuleSet:
    """BertModel checkpoints carry no prefix; the head classes nest it under ``bert.``, as in HF."""
    base = config.architecture == "BertModel"
    o, p = ("", "") if base else ("bert.", "bert.")
    layer = f"{p}encoder.layer.{{layer}}."
    block = f"{o}blocks.{{layer}}."
    rules = [
        Rule(f"{o}embed.tokens.weight", f"{p}embeddings.word_embeddings.weight"),
        Rule(f"{o}embed.positions.weight", f"{p}embeddings.position_embeddings.weight"),
        Rule(f"{o}embed.token_types.weight", f"{p}embeddings.token_type_embeddings.weight"),
        *_pairs(f"{o}embed_norm", f"{p}embeddings.LayerNorm"),
        *_qkv(f"{block}attn.qkv", tuple(f"{layer}attention.self.{n}" for n in ("query", "key", "value")), config.hidden_size),
        *_pairs(f"{block}attn.out_proj", f"{layer}attention.output.dense"),
        *_pairs(f"{block}norm1", f"{layer}attention.output.LayerNorm"),
        *_pairs(f"{block}mlp.fc1", f"{layer}intermediate.dense"),
        *_pairs(f"{block}mlp.fc2", f"{layer}output.dense"),
        *_pairs(f"{block}norm2", f"{layer}output.LayerNorm"),
    ]
    ignore = [(r"bert\." if p else "") + r"embeddings\.(position_ids|token_type_ids)"]  # buffers of older versions
    with_pooler = config.architecture in ("BertModel", "BertForPreTraining", "BertForSequenceClassification")
    if with_pooler:
        rules += _pairs(f"{o}pooler", f"{p}pooler.dense")
    else:
        ignore.append(r"bert\.pooler\..*")  # pretraining checkpoints loaded for MLM or tagging carry one
    if config.architecture in ("BertForPreTraining", "BertForMaskedLM"):
        rules += [*_pairs("mlm.dense", "cls.predictions.transform.dense"),
                  *_pairs("mlm.norm", "cls.predictions.transform.LayerNorm"),
                  Rule("mlm.bias", "cls.predictions.bias")]
        ignore.append(r"cls\.predictions\.decoder\.bias")  # tied to cls.predictions.bias
        if config.tie_word_embeddings:
            ignore.append(r"cls\.predictions\.decoder\.weight")
        else:
            rules.append(Rule("mlm.decoder.weight", "cls.predictions.decoder.weight"))
    if config.architecture == "BertForPreTraining":
        rules += _pairs("nsp", "cls.seq_relationship")
    elif config.architecture == "BertForMaskedLM":
        ignore.append(r"cls\.seq_relationship\..*")  # the NSP head of a pretraining checkpoint
    if config.architecture in ("BertForSequenceClassification", "BertForTokenClassification"):
        rules += _pairs("classifier", "classifier")
    return RuleSet(tuple(rules), ignore=tuple(ignore), legacy_keys=_BERT_LEGACY)


# Key names of ViT checkpoints written by transformers < 5 -> today's.
_VIT_LEGACY = tuple(
    (rf"encoder\.layer\.(\d+)\.{old}\.", rf"layers.\1.{new}.")
    for old, new in {
        r"attention\.attention\.query": "attention.q_proj", r"attention\.attention\.key": "attention.k_proj",
        r"attention\.attention\.value": "attention.v_proj", r"attention\.output\.dense": "attention.o_proj",
        r"intermediate\.dense": "mlp.fc1", r"output\.dense": "mlp.fc2", "layernorm_before": "layernorm_before",
        "layernorm_after": "layernorm_after",
    }.items()
)


def vit_rules(config) -> RuleSet:
    """HF ViTModel (no prefix, with pooler) or ViTForImageClassification (``vit.`` prefix, classifier)."""
    base = config.architecture == "ViTModel"
    p = "" if base else "vit."
    layer, block = f"{p}layers.{{layer}}.", "blocks.{layer}."
    rules = [
        Rule("cls_token", f"{p}embeddings.cls_token"),
        Rule("pos_embed", f"{p}embeddings.position_embeddings"),
        *_pairs("patch_embed", f"{p}embeddings.patch_embeddings.projection"),
        *_qkv(f"{block}attn.qkv", tuple(f"{layer}attention.{n}_proj" for n in "qkv"), config.hidden_size, bias=config.qkv_bias),
        *_pairs(f"{block}attn.out_proj", f"{layer}attention.o_proj"),
        *_pairs(f"{block}norm1", f"{layer}layernorm_before"),
        *_pairs(f"{block}norm2", f"{layer}layernorm_after"),
        *_pairs(f"{block}mlp.fc1", f"{layer}mlp.fc1"),
        *_pairs(f"{block}mlp.fc2", f"{layer}mlp.fc2"),
        *_pairs("norm", f"{p}layernorm"),
    ]
    ignore = []
    if config.pooler:
        rules += _pairs("pooler", f"{p}pooler.dense")
    elif not base:
        ignore.append(r"vit\.pooler\..*")  # a ViTModel-with-pooler checkpoint fine-tuned for classification
    if config.num_classes:
        rules += _pairs("head", "classifier")
    return RuleSet(tuple(rules), ignore=tuple(ignore), legacy_keys=_VIT_LEGACY)


def timm_vit_rules(config) -> RuleSet:
    """timm's VisionTransformer: its fused qkv has our [q; k; v] row order already."""
    rules = [
        *_pairs("patch_embed", "patch_embed.proj", bias=config.patch_bias),
        Rule("pos_embed", "pos_embed"),
        *_pairs("blocks.{layer}.attn.qkv", "blocks.{layer}.attn.qkv", bias=config.qkv_bias),
        *_pairs("blocks.{layer}.attn.out_proj", "blocks.{layer}.attn.proj"),
        *_pairs("blocks.{layer}.norm1", "blocks.{layer}.norm1"),
        *_pairs("blocks.{layer}.norm2", "blocks.{layer}.norm2"),
        *_pairs("blocks.{layer}.mlp.fc1", "blocks.{layer}.mlp.fc1"),
        *_pairs("blocks.{layer}.mlp.fc2", "blocks.{layer}.mlp.fc2"),
    ]
    if config.class_token:
        rules.append(Rule("cls_token", "cls_token"))
    if config.reg_tokens:
        rules.append(Rule("reg_token", "reg_token"))
    for ours, present in (("norm_pre", config.pre_norm), ("norm", config.final_norm and not config.use_fc_norm),
                          ("fc_norm", config.final_norm and config.use_fc_norm)):
        if present:
            rules += _pairs(ours, ours)
    if config.num_classes:
        rules += _pairs("head", "head")
    return RuleSet(tuple(rules))


