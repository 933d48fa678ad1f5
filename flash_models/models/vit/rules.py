"""ViT's checkpoint rules: HF's layouts (ViTModel, ViTForImageClassification) and timm's."""

from __future__ import annotations

from ..checkpoint_rules import Rule, RuleSet, fused_qkv, pairs
from .config import ViTConfig


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


def vit_rules(config: ViTConfig) -> RuleSet:
    """HF ViTModel (no prefix, with pooler) or ViTForImageClassification (``vit.`` prefix, classifier)."""
    base = config.architecture == "ViTModel"
    p = "" if base else "vit."
    layer, block = f"{p}layers.{{layer}}.", "blocks.{layer}."
    rules = [
        Rule("cls_token", f"{p}embeddings.cls_token"),
        Rule("pos_embed", f"{p}embeddings.position_embeddings"),
        *pairs("patch_embed", f"{p}embeddings.patch_embeddings.projection"),
        *fused_qkv(f"{block}attn.qkv", tuple(f"{layer}attention.{n}_proj" for n in "qkv"), config.hidden_size, bias=config.qkv_bias),
        *pairs(f"{block}attn.out_proj", f"{layer}attention.o_proj"),
        *pairs(f"{block}norm1", f"{layer}layernorm_before"),
        *pairs(f"{block}norm2", f"{layer}layernorm_after"),
        *pairs(f"{block}mlp.fc1", f"{layer}mlp.fc1"),
        *pairs(f"{block}mlp.fc2", f"{layer}mlp.fc2"),
        *pairs("norm", f"{p}layernorm"),
    ]
    ignore = []
    if config.pooler:
        rules += pairs("pooler", f"{p}pooler.dense")
    elif not base:
        ignore.append(r"vit\.pooler\..*")  # a ViTModel-with-pooler checkpoint fine-tuned for classification
    if config.num_classes:
        rules += pairs("head", "classifier")
    return RuleSet(tuple(rules), ignore=tuple(ignore), legacy_keys=_VIT_LEGACY)


def timm_vit_rules(config: ViTConfig) -> RuleSet:
    """timm's VisionTransformer: its fused qkv has our [q; k; v] row order already."""
    rules = [
        *pairs("patch_embed", "patch_embed.proj", bias=config.patch_bias),
        Rule("pos_embed", "pos_embed"),
        *pairs("blocks.{layer}.attn.qkv", "blocks.{layer}.attn.qkv", bias=config.qkv_bias),
        *pairs("blocks.{layer}.attn.out_proj", "blocks.{layer}.attn.proj"),
        *pairs("blocks.{layer}.norm1", "blocks.{layer}.norm1"),
        *pairs("blocks.{layer}.norm2", "blocks.{layer}.norm2"),
        *pairs("blocks.{layer}.mlp.fc1", "blocks.{layer}.mlp.fc1"),
        *pairs("blocks.{layer}.mlp.fc2", "blocks.{layer}.mlp.fc2"),
    ]
    if config.class_token:
        rules.append(Rule("cls_token", "cls_token"))
    if config.reg_tokens:
        rules.append(Rule("reg_token", "reg_token"))
    for ours, present in (("norm_pre", config.pre_norm), ("norm", config.final_norm and not config.use_fc_norm),
                          ("fc_norm", config.final_norm and config.use_fc_norm)):
        if present:
            rules += pairs(ours, ours)
    if config.num_classes:
        rules += pairs("head", "head")
    return RuleSet(tuple(rules))
