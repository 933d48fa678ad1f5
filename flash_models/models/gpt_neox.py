"""GPT-NeoX / Pythia (HF ``model_type`` "gpt_neox"): parallel residual with two LayerNorms (or the sequential
variant), partial half-split rotary (``partial_rotary_factor``, the old ``rotary_pct``), untied head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import AttentionConfig, DecoderConfig, MLPConfig, RopeConfig, head_dim_of
from .checkpoint_rules import Rule, RuleSet, Transform, layer_rules, linears, lm_head, norms
from .decoder import DecoderLM
from .family import Family, Preset, hf_class, hf_token_ids, token_ids

if TYPE_CHECKING:
    import transformers

__all__ = ["GPTNeoXConfig", "GPTNeoXForCausalLM"]


@dataclass(frozen=True)
class GPTNeoXConfig:
    vocab_size: int = 50432
    hidden_size: int = 6144
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    intermediate_size: int = 24576
    hidden_act: str = "gelu"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    classifier_dropout: float = 0.1
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    use_parallel_residual: bool = True
    attention_bias: bool = True
    rope: RopeConfig | None = None  # HF: rope_parameters, with partial_rotary_factor below
    partial_rotary_factor: float = 0.25
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None

    model_type = "gpt_neox"
    hf_config_class = "GPTNeoXConfig"
    _PLAIN = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "attention_dropout", "hidden_dropout", "classifier_dropout", "max_position_embeddings", "initializer_range",
        "layer_norm_eps", "tie_word_embeddings", "use_parallel_residual", "attention_bias", "bos_token_id", "pad_token_id",
    )

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.hidden_size, self.num_attention_heads)

    @classmethod
    def from_hf(cls, hf: transformers.GPTNeoXConfig) -> GPTNeoXConfig:
        params = dict(hf.rope_parameters or {})
        factor = float(params.get("partial_rotary_factor", 1.0))
        head_dim = hf.hidden_size // hf.num_attention_heads
        rope = RopeConfig.from_hf_parameters(
            params, rotary_dim=int(head_dim * factor), max_position_embeddings=hf.max_position_embeddings
        )
        return cls(**{name: getattr(hf, name) for name in cls._PLAIN}, rope=rope, partial_rotary_factor=factor,
                   eos_token_id=token_ids(hf.eos_token_id))

    def to_hf(self) -> transformers.GPTNeoXConfig:
        return hf_class(self.hf_config_class)(
            **{name: getattr(self, name) for name in self._PLAIN}, eos_token_id=hf_token_ids(self.eos_token_id),
            rope_parameters=self.rope_or_default().to_hf_parameters(partial_rotary_factor=self.partial_rotary_factor),
        )

    def rope_or_default(self) -> RopeConfig:
        return self.rope or RopeConfig(rotary_dim=int(self.head_dim * self.partial_rotary_factor),
                                       max_position_embeddings=self.max_position_embeddings)

    def decoder(self) -> DecoderConfig:
        h = self.hidden_size
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=h,
            num_layers=self.num_hidden_layers,
            attention=AttentionConfig(
                hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.num_attention_heads,
                head_dim=self.head_dim, qkv_bias=self.attention_bias, out_bias=self.attention_bias,
                dropout_p=self.attention_dropout,
            ),
            mlp=MLPConfig(hidden_size=h, intermediate_size=self.intermediate_size, activation=self.hidden_act),
            norm="layer_norm",
            norm_eps=self.layer_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope=self.rope_or_default(),
            tie_word_embeddings=self.tie_word_embeddings,
            embed_dropout_p=self.hidden_dropout,
            residual_dropout_p=self.hidden_dropout,
            initializer_range=self.initializer_range,
            block="parallel" if self.use_parallel_residual else "pre_norm",
        )


class GPTNeoXForCausalLM(DecoderLM):
    config_class = GPTNeoXConfig


def _heads_interleaved_qkv(num_heads: int) -> Transform:
    """GPT-NeoX fuses qkv per head, rows ordered (head, [q k v], dim); ours are ([q k v], head, dim)."""

    def to_ours(parts):
        w = parts[0]
        return w.reshape(num_heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()

    def to_hf(t):
        return [t.reshape(3, num_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()]

    return Transform(f"neox_qkv(heads={num_heads})", to_ours, to_hf, linear_view="rows")


def gpt_neox_rules(config: GPTNeoXConfig) -> RuleSet:
    p = "gpt_neox."
    qkv = _heads_interleaved_qkv(config.num_attention_heads)
    attn = {"attn.qkv.weight": (("attention.query_key_value.weight",), qkv)}
    if config.attention_bias:
        attn["attn.qkv.bias"] = (("attention.query_key_value.bias",), qkv)
    attn.update(linears({"attn.out_proj": "attention.dense"}, bias=config.attention_bias))
    mlp = linears({"mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h"}, bias=True)
    rules = layer_rules(p, "layers", attn, mlp, norms({"norm1": "input_layernorm", "norm2": "post_attention_layernorm"})) + [
        Rule("embed.tokens.weight", f"{p}embed_in.weight"),
        Rule("norm_f.weight", f"{p}final_layer_norm.weight"),
        Rule("norm_f.bias", f"{p}final_layer_norm.bias"),
    ]
    ignore = [r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)", r"gpt_neox\.rotary_emb\.inv_freq"]
    lm_head(config, rules, ignore)
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",),
                   legacy_keys=((r"^embed_out\.weight$", "lm_head.weight"),))  # transformers < 5 named the head embed_out


def gpt_neox_tiny(preset: dict) -> dict:
    return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128,
                max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.1)


FAMILY = Family(
    config_class=GPTNeoXConfig, model_class=GPTNeoXForCausalLM, rules=gpt_neox_rules, tiny=gpt_neox_tiny,
    presets=tuple(
        Preset(name, "gpt_neox",
               dict(vocab_size=50304, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=4 * hidden, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                    max_position_embeddings=2048),
               description=f"Pythia shape: {layers} layers, hidden {hidden}, parallel residual, 25% rotary")
        for name, (hidden, layers, heads) in {"pythia-160m": (768, 12, 12), "pythia-1b": (2048, 16, 8)}.items()
    ),
)
