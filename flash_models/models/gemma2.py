"""Gemma 2 (HF ``model_type`` "gemma2"): Gemma's norms (1 + weight), scaled embeddings and GeGLU in a block that
normalizes each sublayer's output too (``SandwichBlock``: four norms), attention scores soft-capped
(``attn_logit_softcapping``) and scaled by ``query_pre_attn_scalar`` ** -0.5, a sliding window on the layers
``layer_types`` names (every other one in the released models), and the logits soft-capped
(``final_logit_softcapping``) in the output, the loss and generation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import DecoderConfig
from .family import Family, Preset
from .gemma import GemmaConfig, gemma_tiny
from .llama import LlamaForCausalLM, llama_rules

__all__ = ["Gemma2Config", "Gemma2ForCausalLM"]

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    query_pre_attn_scalar: int = 256
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] | None = None  # None: HF's default, a window on every other layer from the first
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0

    model_type = "gemma2"
    hf_config_class = "Gemma2Config"
    # HF names the activation hidden_activation here (read and written by hand below).
    _PLAIN = tuple(name for name in GemmaConfig._PLAIN if name != "hidden_act") + (
        "query_pre_attn_scalar", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping")

    def __post_init__(self):
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"gemma2: layer_types names {len(self.layer_types)} layers, the model has "
                                 f"{self.num_hidden_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"gemma2: layer_types {unknown} are not supported; use {list(LAYER_TYPES)}")

    @classmethod
    def from_hf(cls, hf) -> Gemma2Config:
        config = super().from_hf(hf)
        return dataclasses.replace(config, hidden_act=hf.hidden_activation,
                                   layer_types=tuple(hf.layer_types) if hf.layer_types is not None else None)

    def hf_extra_fields(self) -> dict:
        return {"hidden_activation": self.hidden_act, "layer_types": list(self.types())}

    def types(self) -> tuple[str, ...]:
        """Each layer's attention, HF's default where the config names none."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers))

    def sliding_window_size(self) -> int | None:
        return self.sliding_window if "sliding_attention" in self.types() else None

    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.types()) if kind == "full_attention")

    def decoder(self) -> DecoderConfig:
        dc = super().decoder()
        attention = dataclasses.replace(dc.attention, softcap=self.attn_logit_softcapping,
                                        softmax_scale=self.query_pre_attn_scalar ** -0.5)
        return dataclasses.replace(dc, attention=attention, block="sandwich",
                                   final_logit_softcap=self.final_logit_softcapping)


class Gemma2ForCausalLM(LlamaForCausalLM):
    config_class = Gemma2Config


# Our four block norms <- HF's: its post_attention_layernorm normalizes the attention's output (LLaMA's, the
# stream before the MLP), and pre_feedforward_layernorm is the norm before the MLP.
GEMMA2_NORMS = {"norm1.weight": "input_layernorm.weight", "post_attn_norm.weight": "post_attention_layernorm.weight",
                "norm2.weight": "pre_feedforward_layernorm.weight",
                "post_mlp_norm.weight": "post_feedforward_layernorm.weight"}


def gemma2_rules(config: Gemma2Config):
    return llama_rules(config, GEMMA2_NORMS)


def gemma2_tiny(preset: dict) -> dict:
    # A window shorter than the tests' sequences, so that it acts on the sliding layers.
    return {**gemma_tiny(preset), "sliding_window": 5}


FAMILY = Family(
    config_class=Gemma2Config, model_class=Gemma2ForCausalLM, rules=gemma2_rules, tiny=gemma2_tiny,
    presets=(
        Preset("gemma2-2b", "gemma2",
               dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, tie_word_embeddings=True),
               description="Gemma-2-2B shape: 26 layers, hidden 2304, GQA 8/4 of head dim 256, a 4096-token window on "
                           "every other layer, soft-capped scores and logits"),
        Preset("gemma2-9b", "gemma2",
               dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=8192,
                    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, tie_word_embeddings=True),
               description="Gemma-2-9B shape: 42 layers, hidden 3584, GQA 16/8 of head dim 256, a 4096-token window on "
                           "every other layer, soft-capped scores and logits"),
    ),
)
