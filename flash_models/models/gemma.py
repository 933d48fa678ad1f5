"""Gemma (HF ``model_type`` "gemma"): LLaMA's block with RMSNorms that scale by ``1 + weight`` (the weights are
stored as offsets from one), token embeddings multiplied by sqrt(hidden_size) rounded to the table's dtype, a
GELU-tanh gated MLP (GeGLU), an explicit head dim (256 in the released sizes, which 7B's hidden / heads is not),
and the LM head tied to the embeddings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import DecoderConfig
from .family import Family, Preset
from .llama import LlamaConfig, LlamaForCausalLM, llama_like_tiny, llama_rules

__all__ = ["GemmaConfig", "GemmaForCausalLM"]


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    vocab_size: int = 256000
    hidden_size: int = 3072
    intermediate_size: int = 24576
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 256
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | tuple[int, ...] | None = 2
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = 0

    model_type = "gemma"
    hf_config_class = "GemmaConfig"
    # HF's GemmaConfig has no mlp_bias (its MLP has none); every other plain field is LLaMA's.
    _PLAIN = tuple(name for name in LlamaConfig._PLAIN if name != "mlp_bias")

    @classmethod
    def from_hf(cls, hf) -> GemmaConfig:
        if getattr(hf, "use_bidirectional_attention", None):
            raise ValueError("gemma: use_bidirectional_attention=True (every token attending to all others, as "
                             "EmbeddingGemma does) is not supported; our Gemma is the causal LM")
        return super().from_hf(hf)

    def decoder(self) -> DecoderConfig:
        return dataclasses.replace(super().decoder(), norm_zero_centered=True, embed_scale=self.hidden_size**0.5)


class GemmaForCausalLM(LlamaForCausalLM):
    config_class = GemmaConfig


def gemma_tiny(preset: dict) -> dict:
    # A head dim other than hidden / heads (64 / 4), as Gemma-7B's (3072 / 16 heads of 256).
    return {**llama_like_tiny(preset), "head_dim": 32}


FAMILY = Family(
    config_class=GemmaConfig, model_class=GemmaForCausalLM, rules=llama_rules, tiny=gemma_tiny,
    presets=(
        Preset("gemma-2b", "gemma",
               dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                    rms_norm_eps=1e-6, tie_word_embeddings=True),
               description="Gemma-2B shape: 18 layers, hidden 2048, multi-query (8 heads, 1 KV head) of head dim 256, "
                           "GeGLU, tied embeddings"),
        Preset("gemma-7b", "gemma",
               dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=16, head_dim=256, max_position_embeddings=8192,
                    rms_norm_eps=1e-6, tie_word_embeddings=True),
               description="Gemma-7B shape: 28 layers, hidden 3072, 16 heads of head dim 256, GeGLU, tied embeddings"),
    ),
)
