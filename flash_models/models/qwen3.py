"""Qwen3 (HF ``model_type`` "qwen3"): Qwen2's block with an RMSNorm over each head's channels of q and k before
rotary (``q_norm`` / ``k_norm``), an explicit ``head_dim``, and one ``attention_bias`` switch for all four
projections (off in released checkpoints). A sliding window from ``max_window_layers`` on, as for Qwen2."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .checkpoint_rules import IDENTITY, RuleSet, layer_rules
from .family import Family, Preset
from .llama import LlamaConfig, llama_like_tiny, llama_rules
from .qwen2 import Qwen2Config, Qwen2ForCausalLM

__all__ = ["Qwen3Config", "Qwen3ForCausalLM"]


@dataclass(frozen=True)
class Qwen3Config(Qwen2Config):
    model_type = "qwen3"
    hf_config_class = "Qwen3Config"
    _PLAIN = Qwen2Config._PLAIN + ("attention_bias",)

    @classmethod
    def hf_head_dim(cls, hf) -> int:
        return LlamaConfig.hf_head_dim(hf)

    def attention_biases(self) -> tuple[bool, bool]:
        return self.attention_bias, self.attention_bias

    def qk_norm_eps(self) -> float | None:
        return self.rms_norm_eps


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    config_class = Qwen3Config


def qwen3_rules(config: Qwen3Config) -> RuleSet:
    """LLaMA's rules plus the per-head q and k norms."""
    rules = llama_rules(config)
    qk_norms = {f"attn.{n}.weight": ((f"self_attn.{n}.weight",), IDENTITY) for n in ("q_norm", "k_norm")}
    return replace(rules, rules=rules.rules + tuple(layer_rules("model.", "layers", qk_norms)))


def qwen3_tiny(preset: dict) -> dict:
    # A head dim other than hidden / heads (64 / 4), as Qwen3's sizes have (1024 / 16 heads of 128).
    return {**llama_like_tiny(preset), "head_dim": 24}


FAMILY = Family(
    config_class=Qwen3Config, model_class=Qwen3ForCausalLM, rules=qwen3_rules, tiny=qwen3_tiny,
    presets=(
        Preset("qwen3-0.6b", "qwen3",
               dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, max_window_layers=28,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
               description="Qwen3-0.6B shape: 28 layers, hidden 1024, GQA 16/8, head dim 128, q/k norm, tied embeddings"),
    ),
)
