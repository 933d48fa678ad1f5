"""LLaMA (HF ``model_type`` "llama"): RMSNorm, rotary (with HF's scaling rules), GQA, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import AttentionConfig, DecoderConfig, MLPConfig, RopeConfig
from .checkpoint_rules import IDENTITY, Rule, RuleSet, concat, layer_rules, lm_head
from .decoder import DecoderLM
from .family import Family, Preset, hf_class, hf_token_ids, token_ids

__all__ = ["LlamaConfig", "LlamaForCausalLM"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope: RopeConfig | None = None  # HF: rope_parameters
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    bos_token_id: int | tuple[int, ...] | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None

    model_type = "llama"
    hf_config_class = "LlamaConfig"
    # Fields copied as they are between HF's config and ours.
    _PLAIN = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
        "rms_norm_eps", "tie_word_embeddings", "attention_bias", "attention_dropout", "mlp_bias", "pad_token_id",
    )

    @classmethod
    def from_hf(cls, hf) -> LlamaConfig:
        params = dict(hf.rope_parameters or {})
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{cls.model_type}: partial_rotary_factor != 1 is not supported")
        head_dim = cls.hf_head_dim(hf)
        rope = RopeConfig.from_hf_parameters(
            params, rotary_dim=head_dim, max_position_embeddings=hf.max_position_embeddings
        )
        return cls(
            **{name: getattr(hf, name) for name in cls._PLAIN if name != "head_dim"},
            head_dim=head_dim,
            rope=rope,
            bos_token_id=token_ids(hf.bos_token_id),
            eos_token_id=token_ids(hf.eos_token_id),
        )

    @classmethod
    def hf_head_dim(cls, hf) -> int:
        return hf.head_dim or hf.hidden_size // hf.num_attention_heads

    def to_hf(self):
        return hf_class(self.hf_config_class)(
            **{name: getattr(self, name) for name in self._PLAIN},
            rope_parameters=self.hf_rope_parameters(),
            bos_token_id=hf_token_ids(self.bos_token_id),
            eos_token_id=hf_token_ids(self.eos_token_id),
            **self.hf_extra_fields(),
        )

    def hf_extra_fields(self) -> dict:
        """HF config fields a family writes beside the plain ones (under another name, or in another form)."""
        return {}

    def hf_rope_parameters(self) -> dict:
        return self.rope_or_default().to_hf_parameters()

    def rope_or_default(self) -> RopeConfig:
        return self.rope or RopeConfig(rotary_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings)

    def sliding_window_size(self) -> int | None:
        return None

    def full_attention_layers(self) -> tuple[int, ...]:
        """Layers without the sliding window (Qwen2's below max_window_layers); empty: it applies to all."""
        return ()

    def qk_norm_eps(self) -> float | None:
        """The epsilon of a per-head RMSNorm on q and k (Qwen3); None: no such norm."""
        return None

    def attention_biases(self) -> tuple[bool, bool]:
        """(qkv projection bias, output projection bias)."""
        return self.attention_bias, self.attention_bias

    def decoder(self) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers,
            attention=AttentionConfig(
                hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
                num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, qkv_bias=self.attention_biases()[0],
                out_bias=self.attention_biases()[1], dropout_p=self.attention_dropout,
                sliding_window=self.sliding_window_size(), qk_norm_eps=self.qk_norm_eps(),
            ),
            mlp=MLPConfig(
                hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, activation=self.hidden_act,
                gated=True, bias=self.mlp_bias,
            ),
            norm="rms_norm",
            norm_eps=self.rms_norm_eps,
            norm_bias=False,
            max_position_embeddings=self.max_position_embeddings,
            rope=self.rope_or_default(),
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            padding_idx=self.pad_token_id,
            full_attention_layers=self.full_attention_layers(),
        )


assert set(LlamaConfig._PLAIN) <= {f.name for f in fields(LlamaConfig)}


class LlamaForCausalLM(DecoderLM):
    config_class = LlamaConfig


# A block's norms: ours <- HF's (LLaMA's two; Gemma 2 has four).
LLAMA_NORMS = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight"}


def llama_rules(config: LlamaConfig, norms: dict[str, str] = LLAMA_NORMS) -> RuleSet:
    """HF's separate q/k/v and gate/up projections <-> our fused ones; Qwen2's bias on q/k/v only; ``norms``
    names each block norm's HF key."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv_sizes = (hq * d, hkv * d, hkv * d)
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attn = {"attn.qkv.weight": (tuple(f"{n}.weight" for n in qkv), concat(qkv_sizes)),
            "attn.out_proj.weight": (("self_attn.o_proj.weight",), IDENTITY)}
    qkv_bias, out_bias = config.attention_biases()
    if qkv_bias:
        attn["attn.qkv.bias"] = (tuple(f"{n}.bias" for n in qkv), concat(qkv_sizes))
    if out_bias:
        attn["attn.out_proj.bias"] = (("self_attn.o_proj.bias",), IDENTITY)
    inter = config.intermediate_size
    mlp = {
        "mlp.gate_up.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), concat((inter, inter))),
        "mlp.down.weight": (("mlp.down_proj.weight",), IDENTITY),
    }
    if config.mlp_bias:
        mlp["mlp.gate_up.bias"] = (("mlp.gate_proj.bias", "mlp.up_proj.bias"), concat((inter, inter)))
        mlp["mlp.down.bias"] = (("mlp.down_proj.bias",), IDENTITY)
    return llama_layout_rules(config, attn, mlp, norms)


def llama_layout_rules(config, attn: dict, mlp: dict, norms: dict[str, str] = LLAMA_NORMS) -> RuleSet:
    """HF's LLaMA layout (``model.layers.N``, the block's norms, embeddings, final norm, head) around a block's
    attention and MLP keys (``layer_rules`` dicts), which differ between the families that share the rest."""
    p = "model."
    norms = {ours: ((theirs,), IDENTITY) for ours, theirs in norms.items()}
    rules = layer_rules(p, "layers", attn, mlp, norms) + [
        Rule("embed.tokens.weight", f"{p}embed_tokens.weight"),
        Rule("norm_f.weight", f"{p}norm.weight"),
    ]
    ignore = [r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq"]
    lm_head(config, rules, ignore)
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",))


def llama_like_tiny(preset: dict) -> dict:
    """Test size for LLaMA-like presets, keeping the preset's ratio of query to key/value heads."""
    heads = preset.get("num_attention_heads", 32)
    ratio = heads // preset.get("num_key_value_heads", heads)
    return dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=max(1, 4 // ratio), vocab_size=128, max_position_embeddings=64)


FAMILY = Family(
    config_class=LlamaConfig, model_class=LlamaForCausalLM, rules=llama_rules, tiny=llama_like_tiny,
    presets=(
        Preset("llama-1b", "llama",
               dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5),
               description="TinyLlama-1.1B shape: 22 layers, hidden 2048, GQA 32/4"),
        Preset("smollm2-135m", "llama",
               dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=1, eos_token_id=2),
               description="SmolLM2-135M shape: 30 layers, hidden 576, GQA 9/3, tied embeddings"),
        Preset("llama-7b", "llama",
               dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5),
               description="LLaMA-2-7B shape"),
    ),
)
