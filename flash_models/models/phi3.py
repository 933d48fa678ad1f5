"""Phi-3 (HF ``model_type`` "phi3"): LLaMA's block with q/k/v and gate/up stored fused in the checkpoint (our own
layout, so they load as they are), dropout on each branch's output before the residual add (``resid_pdrop``),
an optional sliding window (Phi-3-mini-4k's 2047), LongRoPE for the 128k variants and partial rotary
(``partial_rotary_factor``: the first channels of each head rotate, Phi-4-mini's 3/4)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..config import DecoderConfig, RopeConfig
from .checkpoint_rules import IDENTITY, RuleSet
from .family import Family, Preset, token_ids
from .llama import LlamaConfig, LlamaForCausalLM, llama_layout_rules, llama_like_tiny

__all__ = ["Phi3Config", "Phi3ForCausalLM"]


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    bos_token_id: int | tuple[int, ...] | None = 1
    eos_token_id: int | tuple[int, ...] | None = 32000
    pad_token_id: int | None = 32000
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0  # kept for the round trip: HF's Phi-3 applies no dropout to the embeddings
    original_max_position_embeddings: int = 4096
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 keys before it
    partial_rotary_factor: float = 1.0

    model_type = "phi3"
    hf_config_class = "Phi3Config"
    # HF's Phi3Config has no head_dim (hidden / heads) and no bias switches (its projections have none).
    _PLAIN = tuple(n for n in LlamaConfig._PLAIN if n not in ("head_dim", "attention_bias", "mlp_bias")) + (
        "resid_pdrop", "embd_pdrop", "original_max_position_embeddings", "sliding_window")

    @classmethod
    def from_hf(cls, hf) -> Phi3Config:
        params = dict(hf.rope_parameters or {})
        partial = float(params.get("partial_rotary_factor", 1.0))
        head_dim = cls.hf_head_dim(hf)
        rope = RopeConfig.from_hf_parameters(params, rotary_dim=int(head_dim * partial),
                                             max_position_embeddings=hf.max_position_embeddings)
        return cls(**{name: getattr(hf, name) for name in cls._PLAIN}, head_dim=head_dim, rope=rope,
                   partial_rotary_factor=partial, bos_token_id=token_ids(hf.bos_token_id),
                   eos_token_id=token_ids(hf.eos_token_id))

    @classmethod
    def hf_head_dim(cls, hf) -> int:
        return hf.hidden_size // hf.num_attention_heads

    def hf_rope_parameters(self) -> dict:
        return self.rope_or_default().to_hf_parameters(partial_rotary_factor=self.partial_rotary_factor)

    def rope_or_default(self) -> RopeConfig:
        return self.rope or RopeConfig(rotary_dim=int(self.head_dim * self.partial_rotary_factor),
                                       max_position_embeddings=self.max_position_embeddings)

    def sliding_window_size(self) -> int | None:
        return self.sliding_window

    def decoder(self) -> DecoderConfig:
        return replace(super().decoder(), residual_dropout_p=self.resid_pdrop, recompute_cache_at_rope_switch=True)


assert set(Phi3Config._PLAIN) <= {f.name for f in fields(Phi3Config)}


class Phi3ForCausalLM(LlamaForCausalLM):
    config_class = Phi3Config


def phi3_rules(config: Phi3Config) -> RuleSet:
    """HF's fused ``qkv_proj`` and ``gate_up_proj`` are ours, row for row ([q; k; v] and [gate; up])."""
    attn = {"attn.qkv.weight": (("self_attn.qkv_proj.weight",), IDENTITY),
            "attn.out_proj.weight": (("self_attn.o_proj.weight",), IDENTITY)}
    mlp = {"mlp.gate_up.weight": (("mlp.gate_up_proj.weight",), IDENTITY),
           "mlp.down.weight": (("mlp.down_proj.weight",), IDENTITY)}
    return llama_layout_rules(config, attn, mlp)


def phi3_tiny(preset: dict) -> dict:
    # A window shorter than the tests' sequences, so that it acts; the pad id inside the tiny vocabulary.
    return {**llama_like_tiny(preset), "sliding_window": 6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


FAMILY = Family(
    config_class=Phi3Config, model_class=Phi3ForCausalLM, rules=phi3_rules, tiny=phi3_tiny,
    presets=(
        Preset("phi3-mini", "phi3",
               dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                    original_max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=2047,
                    bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               description="Phi-3-mini-4k shape: 32 layers, hidden 3072, 32 heads, fused qkv and gate/up, window 2047"),
    ),
)
