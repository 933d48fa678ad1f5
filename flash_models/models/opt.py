"""OPT (HF ``model_type`` "opt"): learned positions with an offset of 2, ReLU MLP, pre-norm or post-norm
blocks (``do_layer_norm_before``), and project_in/project_out when ``word_embed_proj_dim`` != hidden."""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from ..config import AttentionConfig, DecoderConfig, MLPConfig, head_dim_of
from ..registry import Family, Preset, register_family, register_preset
from .decoder import DecoderLM
from .llama import hf_token_ids, token_ids

POSITION_OFFSET = 2  # fairseq reserved the first two rows of OPT's position table


@dataclass(frozen=True)
class OPTConfig:
    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 768
    dropout: float = 0.1
    attention_dropout: float = 0.0
    num_attention_heads: int = 12
    activation_function: str = "relu"
    init_std: float = 0.02
    enable_bias: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 2
    eos_token_id: int | tuple[int, ...] | None = 2

    model_type = "opt"
    _PLAIN = (
        "vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "max_position_embeddings", "do_layer_norm_before",
        "word_embed_proj_dim", "dropout", "attention_dropout", "num_attention_heads", "activation_function", "init_std",
        "enable_bias", "tie_word_embeddings", "pad_token_id", "bos_token_id",
    )

    @classmethod
    def from_hf(cls, hf: transformers.OPTConfig) -> OPTConfig:
        if hf._remove_final_layer_norm:
            raise ValueError("OPT with _remove_final_layer_norm=True is not supported")
        if not hf.layer_norm_elementwise_affine:
            raise ValueError("OPT with layer_norm_elementwise_affine=False is not supported")
        if hf.layerdrop:
            raise ValueError(f"OPT layerdrop={hf.layerdrop} is not supported; set it to 0")
        return cls(**{name: getattr(hf, name) for name in cls._PLAIN}, eos_token_id=token_ids(hf.eos_token_id))

    def to_hf(self) -> transformers.OPTConfig:
        return transformers.OPTConfig(**{name: getattr(self, name) for name in self._PLAIN},
                                      eos_token_id=hf_token_ids(self.eos_token_id))

    def decoder(self) -> DecoderConfig:
        h = self.hidden_size
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=h,
            num_layers=self.num_hidden_layers,
            attention=AttentionConfig(
                hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.num_attention_heads,
                head_dim=head_dim_of(h, self.num_attention_heads), qkv_bias=self.enable_bias, out_bias=self.enable_bias,
                dropout_p=self.attention_dropout,
            ),
            mlp=MLPConfig(hidden_size=h, intermediate_size=self.ffn_dim, activation=self.activation_function,
                          bias=self.enable_bias),
            norm="layer_norm",
            norm_eps=1e-5,
            max_position_embeddings=self.max_position_embeddings,
            learned_positions=True,
            position_offset=POSITION_OFFSET,
            positions_from_mask=True,
            embed_dim=self.word_embed_proj_dim,
            tie_word_embeddings=self.tie_word_embeddings,
            residual_dropout_p=self.dropout,
            initializer_range=self.init_std,
            block="pre_norm" if self.do_layer_norm_before else "post_norm",
            final_norm=self.do_layer_norm_before,
        )


class OPTForCausalLM(DecoderLM):
    config_class = OPTConfig


register_family(Family("opt", OPTConfig, OPTForCausalLM))
register_preset(Preset("opt-125m", "opt", dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                                                word_embed_proj_dim=768),
                       description="OPT-125m shape: pre-norm, 12 layers, hidden 768"))
register_preset(Preset("opt-350m", "opt", dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                                                word_embed_proj_dim=512, do_layer_norm_before=False),
                       description="OPT-350m shape: post-norm, project_in/out 512 <-> 1024"))
