"""GPT-J (HF ``model_type`` "gptj"): parallel attention + MLP under one shared LayerNorm, interleaved rotary
on the first ``rotary_dim`` channels, no qkv bias, an LM head with bias."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import AttentionConfig, DecoderConfig, MLPConfig, RopeConfig, head_dim_of
from .checkpoint_rules import Rule, RuleSet, concat, layer_rules, linears, norms
from .decoder import DecoderLM
from .family import Family, Preset, hf_class, hf_token_ids, token_ids

if TYPE_CHECKING:
    import transformers

__all__ = ["GPTJConfig", "GPTJForCausalLM"]


@dataclass(frozen=True)
class GPTJConfig:
    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int | None = 64  # None: every channel of a head rotates
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    bos_token_id: int | None = 50256
    eos_token_id: int | tuple[int, ...] | None = 50256
    pad_token_id: int | None = None

    model_type = "gptj"
    hf_config_class = "GPTJConfig"
    _PLAIN = (
        "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim", "n_inner", "activation_function",
        "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "bos_token_id",
        "pad_token_id",
    )

    @classmethod
    def from_hf(cls, hf: transformers.GPTJConfig) -> GPTJConfig:
        if hf.tie_word_embeddings:
            raise ValueError("GPT-J with tie_word_embeddings=True is not supported (its LM head has a bias of its own)")
        return cls(**{name: getattr(hf, name) for name in cls._PLAIN}, eos_token_id=token_ids(hf.eos_token_id))

    def to_hf(self) -> transformers.GPTJConfig:
        return hf_class(self.hf_config_class)(**{name: getattr(self, name) for name in self._PLAIN},
                                       eos_token_id=hf_token_ids(self.eos_token_id), tie_word_embeddings=False)

    def decoder(self) -> DecoderConfig:
        head_dim = head_dim_of(self.n_embd, self.n_head)
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.n_embd,
            num_layers=self.n_layer,
            attention=AttentionConfig(
                hidden_size=self.n_embd, num_heads=self.n_head, num_kv_heads=self.n_head, head_dim=head_dim,
                qkv_bias=False, out_bias=False, dropout_p=self.attn_pdrop,
            ),
            mlp=MLPConfig(hidden_size=self.n_embd, intermediate_size=self.n_inner or 4 * self.n_embd,
                          activation=self.activation_function),
            norm="layer_norm",
            norm_eps=self.layer_norm_epsilon,
            max_position_embeddings=self.n_positions,
            rope=RopeConfig(rotary_dim=self.rotary_dim or head_dim, interleaved=True,
                            max_position_embeddings=self.n_positions),
            tie_word_embeddings=False,
            lm_head_bias=True,
            embed_dropout_p=self.embd_pdrop,
            residual_dropout_p=self.resid_pdrop,
            initializer_range=self.initializer_range,
            block="parallel_shared_norm",
        )


class GPTJForCausalLM(DecoderLM):
    config_class = GPTJConfig


def gptj_rules(config: GPTJConfig) -> RuleSet:
    p = "transformer."
    attn = linears({"attn.out_proj": "attn.out_proj"}, bias=False)
    attn["attn.qkv.weight"] = (("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"), concat((config.n_embd,) * 3))
    mlp = linears({"mlp.fc1": "mlp.fc_in", "mlp.fc2": "mlp.fc_out"}, bias=True)
    rules = layer_rules(p, "h", attn, mlp, norms({"norm1": "ln_1"})) + [
        Rule("embed.tokens.weight", f"{p}wte.weight"),
        Rule("norm_f.weight", f"{p}ln_f.weight"),
        Rule("norm_f.bias", f"{p}ln_f.bias"),
        Rule("lm_head.weight", "lm_head.weight"),
        Rule("lm_head.bias", "lm_head.bias"),
    ]
    ignore = [r"transformer\.h\.\d+\.attn\.(bias|masked_bias|embed_positions)"]
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",))


def gptj_tiny(preset: dict) -> dict:
    return dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=128, n_positions=64, resid_pdrop=0.1,
                embd_pdrop=0.1, attn_pdrop=0.1)


FAMILY = Family(
    config_class=GPTJConfig, model_class=GPTJForCausalLM, rules=gptj_rules, tiny=gptj_tiny,
    presets=(Preset("gptj-6b", "gptj", dict(vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64),
                    description="GPT-J-6B shape: 28 layers, hidden 4096, rotary on 64 of 256 head channels"),),
)
