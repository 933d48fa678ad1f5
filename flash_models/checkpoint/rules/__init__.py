"""Per-family checkpoint rules (HF or timm layout <-> ours): one function per ``model_type``, built from our
config. Decoder LMs live in decoders.py, the encoder (BERT) and vision (ViT) families in encoders.py."""

from __future__ import annotations

from typing import Callable

from ..remap import RuleSet
from .decoders import gpt2_rules, gpt_neox_rules, gptj_rules, llama_rules, opt_rules
from .encoders import bert_rules, timm_vit_rules, vit_rules

RULES: dict[str, Callable[[object], RuleSet]] = {
    "gpt2": gpt2_rules,
    "llama": llama_rules,
    "mistral": llama_rules,
    "qwen2": llama_rules,
    "gpt_neox": gpt_neox_rules,
    "gptj": gptj_rules,
    "opt": opt_rules,
    "bert": bert_rules,
    "vit": vit_rules,
}

__all__ = ["RULES", "rules_for", "timm_vit_rules"]


def rules_for(config) -> RuleSet:
    try:
        return RULES[config.model_type](config)
    except KeyError:
        raise ValueError(f"no checkpoint rules for model_type {config.model_type!r}; known: {sorted(RULES)}") from None
