"""Vision Transformer (HF ``model_type`` "vit", and timm's ``VisionTransformer``): config, model and checkpoint
rules for both layouts (``flash_models.from_timm`` reads timm's)."""

from ..family import Family, Preset
from .config import ViTConfig
from .model import VisionTransformer
from .rules import timm_vit_rules, vit_rules

__all__ = ["ViTConfig", "VisionTransformer"]


def vit_tiny(preset: dict) -> dict:
    return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, image_size=32,
                patch_size=8, num_labels=10, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


FAMILY = Family(
    config_class=ViTConfig, model_class=VisionTransformer, rules=vit_rules, tiny=vit_tiny,
    hf_auto_class="AutoModelForImageClassification",
    presets=tuple(
        Preset(name, "vit",
               dict(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * d,
                    image_size=224, patch_size=16, num_labels=1000, architectures=["ViTForImageClassification"]),
               description=f"ViT-{name[4].upper()}/16 at 224 px, ImageNet-1k head")
        for name, (d, layers, heads) in {"vit-b16": (768, 12, 12), "vit-l16": (1024, 24, 16)}.items()
    ),
)
