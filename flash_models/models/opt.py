"""OPT (HF ``model_type`` "opt"): learned positions with an offset of 2, ReLU MLP, pre-norm or post-norm
blocks (``do_layer_norm_before``), and project_in/project_out when ``word_embed_proj_dim`` != hidden."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import AttentionConfig, DecoderConfig, MLPConfig, head_dim_of
from .checkpoint_rules import Rule, RuleSet, concat, layer_rules, linears, lm_head, norms
from .decoder import DecoderLM
from .family import Family, Preset, hf_class, hf_token_ids, token_ids

if TYPE_CHECKING:
    import transformers

__all__ = ["OPTConfig", "OPTForCausalLM"]

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
    hf_config_class = "OPTConfig"
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
        return hf_class(self.hf_config_class)(**{name: getattr(self, name) for name in self._PLAIN},
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
            padding_idx=self.pad_token_id,
            tie_word_embeddings=self.tie_word_embeddings,
            residual_dropout_p=self.dropout,
            initializer_range=self.init_std,
            block="pre_norm" if self.do_layer_norm_before else "post_norm",
            final_norm=self.do_layer_norm_before,
        )


class OPTForCausalLM(DecoderLM):
    config_class = OPTConfig


def opt_rules(config: OPTConfig) -> RuleSet:
    p = "model.decoder."
    h, bias = config.hidden_size, config.enable_bias
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attn = {"attn.qkv.weight": (tuple(f"{n}.weight" for n in qkv), concat((h,) * 3))}
    if bias:
        attn["attn.qkv.bias"] = (tuple(f"{n}.bias" for n in qkv), concat((h,) * 3))
    attn.update(linears({"attn.out_proj": "self_attn.out_proj"}, bias=bias))
    mlp = linears({"mlp.fc1": "fc1", "mlp.fc2": "fc2"}, bias=bias)
    rules = layer_rules(p, "layers", attn, mlp, norms({"norm1": "self_attn_layer_norm", "norm2": "final_layer_norm"})) + [
        Rule("embed.tokens.weight", f"{p}embed_tokens.weight"),
        Rule("embed.positions.weight", f"{p}embed_positions.weight"),
    ]
    if config.do_layer_norm_before:
        rules += [Rule("norm_f.weight", f"{p}final_layer_norm.weight"), Rule("norm_f.bias", f"{p}final_layer_norm.bias")]
    if config.word_embed_proj_dim != h:
        rules += [Rule("embed.project_in.weight", f"{p}project_in.weight"), Rule("project_out.weight", f"{p}project_out.weight")]
    ignore: list[str] = []
    lm_head(config, rules, ignore)
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix="model.", head_prefixes=("lm_head.",))


def opt_tiny(preset: dict) -> dict:
    """Keeps a preset's project_in/out (OPT-350m) by keeping word_embed_proj_dim != hidden_size."""
    projected = preset.get("word_embed_proj_dim", preset.get("hidden_size")) != preset.get("hidden_size")
    return dict(hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=64, word_embed_proj_dim=32 if projected else 64, dropout=0.1)


FAMILY = Family(
    config_class=OPTConfig, model_class=OPTForCausalLM, rules=opt_rules, tiny=opt_tiny,
    presets=(
        Preset("opt-125m", "opt", dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                                       word_embed_proj_dim=768),
               description="OPT-125m shape: pre-norm, 12 layers, hidden 768"),
        Preset("opt-350m", "opt", dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                                       word_embed_proj_dim=512, do_layer_norm_before=False),
               description="OPT-350m shape: post-norm, project_in/out 512 <-> 1024"),
    ),
)
