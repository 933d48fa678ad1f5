"""Mistral (HF ``model_type`` "mistral"): LLaMA's block with a sliding attention window, which the shared
attention mask applies to prefill, cached decoding and the flash kernels alike."""

from __future__ import annotations

from dataclasses import dataclass

from .family import Family, Preset
from .llama import LlamaConfig, LlamaForCausalLM, llama_like_tiny, llama_rules

__all__ = ["MistralConfig", "MistralForCausalLM"]


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    sliding_window: int | None = 4096  # a query sees itself and the sliding_window - 1 keys before it

    model_type = "mistral"
    hf_config_class = "MistralConfig"
    _PLAIN = tuple(n for n in LlamaConfig._PLAIN if n not in ("attention_bias", "mlp_bias")) + ("sliding_window",)

    def sliding_window_size(self) -> int | None:
        return self.sliding_window


class MistralForCausalLM(LlamaForCausalLM):
    config_class = MistralConfig


def mistral_tiny(preset: dict) -> dict:
    return {**llama_like_tiny(preset), "sliding_window": 6}  # shorter than the tests' sequences: the window acts


FAMILY = Family(
    config_class=MistralConfig, model_class=MistralForCausalLM, rules=llama_rules, tiny=mistral_tiny,
    presets=(
        Preset("mistral-7b", "mistral",
               dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
                    sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               description="Mistral-7B-v0.1 shape: GQA 32/8, sliding window 4096"),
    ),
)
