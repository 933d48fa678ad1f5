"""Qwen2 (HF ``model_type`` "qwen2"): LLaMA's block with a bias on the q/k/v projections (none on o_proj).

Qwen2's optional sliding window applies only to layers from ``max_window_layers`` on (the layers below attend
to every earlier key); released checkpoints keep ``use_sliding_window=False``. ``layer_types`` other than the
ones those fields imply are refused."""

from __future__ import annotations

from dataclasses import dataclass

from .family import Family, Preset
from .llama import LlamaConfig, LlamaForCausalLM, llama_like_tiny, llama_rules

__all__ = ["Qwen2Config", "Qwen2ForCausalLM"]


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    use_sliding_window: bool = False
    sliding_window: int | None = None  # HF clears it unless use_sliding_window
    max_window_layers: int = 28

    model_type = "qwen2"
    hf_config_class = "Qwen2Config"
    _PLAIN = tuple(n for n in LlamaConfig._PLAIN if n not in ("attention_bias", "mlp_bias")) + (
        "use_sliding_window", "sliding_window", "max_window_layers",
    )

    @classmethod
    def from_hf(cls, hf) -> Qwen2Config:
        name = cls.__name__.removesuffix("Config")
        layers = hf.num_hidden_layers
        windowed = [i for i, kind in enumerate(hf.layer_types) if kind != "full_attention"]
        # HF's rule when layer_types is not given, which is what to_hf writes back.
        implied = [i for i in range(layers) if hf.sliding_window is not None and i >= hf.max_window_layers]
        if windowed != implied:
            raise ValueError(
                f"{name} layer_types {hf.layer_types} differ from what use_sliding_window={hf.use_sliding_window}, "
                f"sliding_window={hf.sliding_window} and max_window_layers={hf.max_window_layers} imply; "
                "flash-models supports only the latter"
            )
        return super().from_hf(hf)

    def sliding_window_size(self) -> int | None:
        windowed = self.use_sliding_window and self.sliding_window is not None
        return self.sliding_window if windowed and self.max_window_layers < self.num_hidden_layers else None

    def full_attention_layers(self) -> tuple[int, ...]:
        if self.sliding_window_size() is None:
            return ()
        return tuple(range(min(max(self.max_window_layers, 0), self.num_hidden_layers)))

    @classmethod
    def hf_head_dim(cls, hf) -> int:
        # Not a field of HF's Qwen2Config, but its attention takes one that a config.json carries (and to_hf
        # writes it so: transformers reads it back).
        return hf.to_dict().get("head_dim") or hf.hidden_size // hf.num_attention_heads

    def attention_biases(self) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_class = Qwen2Config


FAMILY = Family(
    config_class=Qwen2Config, model_class=Qwen2ForCausalLM, rules=llama_rules, tiny=llama_like_tiny,
    presets=(
        Preset("qwen2-0.5b", "qwen2",
               dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    max_window_layers=24),
               description="Qwen2-0.5B shape: 24 layers, hidden 896, GQA 14/2, qkv bias, tied embeddings"),
    ),
)
