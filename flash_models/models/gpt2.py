"""GPT-2 (HF ``model_type`` "gpt2"): learned positions, LayerNorm, GELU-tanh MLP, tied embeddings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import AttentionConfig, DecoderConfig, MLPConfig, head_dim_of
from .checkpoint_rules import IDENTITY, TRANSPOSE, Rule, RuleSet, layer_rules, lm_head
from .decoder import DecoderLM
from .family import Family, Preset, hf_class

if TYPE_CHECKING:
    import transformers

__all__ = ["GPT2Config", "GPT2LMHeadModel"]


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False  # layer i divides its attention scores by i + 1 as well
    # HF's eager attention then computes the scores and softmax in float32 with autocast off (HF's SDPA path
    # ignores it). Every backend of ours already does: the eager reference upcasts q and k, our kernels
    # accumulate and normalize in float32; SDPA, as in HF, keeps torch's own precision.
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None

    model_type = "gpt2"
    hf_config_class = "GPT2Config"

    @classmethod
    def from_hf(cls, hf: transformers.GPT2Config) -> GPT2Config:
        if hf.add_cross_attention:
            raise ValueError("GPT-2 with add_cross_attention=True (encoder-decoder use) is not supported")
        return cls(**{name: getattr(hf, name) for name in cls.__dataclass_fields__})

    def to_hf(self) -> transformers.GPT2Config:
        return hf_class(self.hf_config_class)(**{name: getattr(self, name) for name in self.__dataclass_fields__})

    def decoder(self) -> DecoderConfig:
        head_dim = head_dim_of(self.n_embd, self.n_head)
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.n_embd,
            num_layers=self.n_layer,
            attention=AttentionConfig(
                hidden_size=self.n_embd, num_heads=self.n_head, num_kv_heads=self.n_head, head_dim=head_dim,
                softmax_scale=None if self.scale_attn_weights else 1.0, dropout_p=self.attn_pdrop,
                scale_by_inverse_layer_idx=self.scale_attn_by_inverse_layer_idx,
            ),
            mlp=MLPConfig(
                hidden_size=self.n_embd, intermediate_size=self.n_inner or 4 * self.n_embd,
                activation=self.activation_function,
            ),
            norm="layer_norm",
            norm_eps=self.layer_norm_epsilon,
            max_position_embeddings=self.n_positions,
            learned_positions=True,
            tie_word_embeddings=self.tie_word_embeddings,
            embed_dropout_p=self.embd_pdrop,
            residual_dropout_p=self.resid_pdrop,
            initializer_range=self.initializer_range,
            scale_residual_init=True,
        )


class GPT2LMHeadModel(DecoderLM):
    config_class = GPT2Config


def gpt2_rules(config: GPT2Config) -> RuleSet:
    """HF's GPT-2 stores its linears as Conv1D, (in, out): transposed to ours."""
    p = "transformer."
    linear = {}
    for ours, hf in {"attn.qkv": "attn.c_attn", "attn.out_proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}.items():
        linear[f"{ours}.weight"] = ((f"{hf}.weight",), TRANSPOSE)
        linear[f"{ours}.bias"] = ((f"{hf}.bias",), IDENTITY)
    norms = {f"norm{i}.{w}": ((f"ln_{i}.{w}",), IDENTITY) for i in (1, 2) for w in ("weight", "bias")}
    rules = layer_rules(p, "h", linear, norms) + [
        Rule("embed.tokens.weight", f"{p}wte.weight"),
        Rule("embed.positions.weight", f"{p}wpe.weight"),
        Rule("norm_f.weight", f"{p}ln_f.weight"),
        Rule("norm_f.bias", f"{p}ln_f.bias"),
    ]
    ignore = [r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"]
    lm_head(config, rules, ignore)
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",))


def gpt2_tiny(preset: dict) -> dict:
    return dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
                attn_pdrop=0.1)


_SIZES = {
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25),
}
FAMILY = Family(
    config_class=GPT2Config, model_class=GPT2LMHeadModel, rules=gpt2_rules, tiny=gpt2_tiny,
    presets=tuple(Preset(name, "gpt2", sizes, description=f"GPT-2 {name.removeprefix('gpt2').strip('-') or 'small'}")
                  for name, sizes in _SIZES.items()),
)
