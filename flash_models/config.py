"""Typed configuration shared by every family.

Each family has one frozen dataclass (in its model file) with ``from_hf(hf_config)`` and ``to_hf()``. It
describes itself to the shared modules through the small typed pieces below, so the modules never look at
HF config objects and never guess a field with ``getattr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ATTN_IMPLS = ("eager", "sdpa", "flash", "auto")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Block variants (modules/block.py): pre-norm (GPT-2, LLaMA), parallel attention + MLP with two norms (GPT-NeoX)
# or one shared norm (GPT-J), and post-norm (BERT, OPT-350m).
BLOCK_KINDS = ("pre_norm", "parallel", "parallel_shared_norm", "post_norm")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {choices}")


def check_finite_values(fields: dict, prefix: str = "") -> None:
    """Refuse NaN and infinity anywhere in a config's fields (nested dicts and lists too): JSON's 1e999 reads
    as inf, and a non-finite epsilon, theta or scale gives a model that computes nothing but NaN."""
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            check_finite_values(value, prefix=name + ".")
        elif isinstance(value, (list, tuple)):
            check_finite_values({f"[{i}]": v for i, v in enumerate(value)}, prefix=name)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config value {name}={value} is not a finite number")


def head_dim_of(hidden_size: int, num_heads: int) -> int:
    """hidden_size / num_heads for families whose heads split the width exactly (HF refuses anything else,
    so a checkpoint saved from such a config could not be read back)."""
    check_positive(num_attention_heads=num_heads)
    if hidden_size % num_heads:
        raise ValueError(f"the hidden size ({hidden_size}) must be a multiple of the number of attention heads "
                         f"({num_heads}), as in HF's config classes")
    return hidden_size // num_heads


def check_positive(**sizes: int | float | None) -> None:
    """Each given size must be > 0 (None: not set, allowed)."""
    for name, value in sizes.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def check_probability(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: which channels rotate, their frequencies and the scaling rule (HF's rope_parameters)."""

    rotary_dim: int
    theta: float = 10000.0
    interleaved: bool = False
    rope_type: str = "default"
    factor: float = 1.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self):
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        check_finite_values({k: v for k, v in vars(self).items() if isinstance(v, float)}, prefix="rope.")
        check_positive(rope_theta=self.theta, rope_factor=self.factor,
                       max_position_embeddings=self.max_position_embeddings)
        if self.rotary_dim % 2 or self.rotary_dim < 0:
            raise ValueError(f"rotary_dim must be even and >= 0, got {self.rotary_dim}")

    @classmethod
    def from_hf_parameters(
        cls, params: dict | None, *, rotary_dim: int, max_position_embeddings: int, interleaved: bool = False,
        default_theta: float = 10000.0,
    ) -> RopeConfig:
        """Read HF's ``rope_parameters`` dict (transformers v5); unknown keys or rope types raise."""
        params = dict(params or {})
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        known = {
            "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
            "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate",
            "partial_rotary_factor",
        }
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"rope_parameters has keys flash-models does not support: {sorted(unknown)}")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        kwargs = {k: params[k] for k in known - {"rope_theta", "partial_rotary_factor"} if params.get(k) is not None}
        return cls(
            rotary_dim=rotary_dim, theta=float(params.get("rope_theta", default_theta)), interleaved=interleaved,
            rope_type=rope_type, max_position_embeddings=max_position_embeddings, **kwargs,
        )

    def to_hf_parameters(self, *, partial_rotary_factor: float | None = None) -> dict:
        params: dict = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type != "default":
            params["factor"] = self.factor
        if self.original_max_position_embeddings is not None:
            params["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            params.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            params.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    params[key] = getattr(self, key)
        if partial_rotary_factor is not None:
            params["partial_rotary_factor"] = partial_rotary_factor
        return params


@dataclass(frozen=True)
class AttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = True
    out_bias: bool = True
    softmax_scale: float | None = None  # None: 1/sqrt(head_dim)
    scale_by_inverse_layer_idx: bool = False  # GPT-2's option: layer i also divides its scores by i + 1
    dropout_p: float = 0.0
    sliding_window: int | None = None
    causal: bool = True
    qk_norm_eps: float | None = None  # Qwen3: each q and k head RMS-normalized over its channels, before rotary

    def __post_init__(self):
        check_positive(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                       num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                       softmax_scale=self.softmax_scale, sliding_window=self.sliding_window)
        check_probability(attention_dropout=self.dropout_p)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )


@dataclass(frozen=True)
class MLPConfig:
    hidden_size: int
    intermediate_size: int
    activation: str
    gated: bool = False
    bias: bool = True
    dropout_p: float = 0.0

    def __post_init__(self):
        check_choice("activation", self.activation, ACTIVATIONS)
        check_positive(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size)
        check_probability(mlp_dropout=self.dropout_p)


@dataclass(frozen=True)
class DecoderConfig:
    """What the shared decoder-only LM needs; each family's config produces one with ``decoder()``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionConfig
    mlp: MLPConfig
    norm: str  # "layer_norm" | "rms_norm"
    norm_eps: float
    norm_bias: bool = True
    max_position_embeddings: int = 2048
    learned_positions: bool = False  # absolute position table (GPT-2); else rotary
    rope: RopeConfig | None = None
    tie_word_embeddings: bool = True
    lm_head_bias: bool = False
    embed_dropout_p: float = 0.0
    residual_dropout_p: float = 0.0
    initializer_range: float = 0.02
    residual_in_fp32: bool = False
    scale_residual_init: bool = False  # GPT-2: output projections init'd with std / sqrt(2 * layers)
    block: str = "pre_norm"  # one of BLOCK_KINDS
    position_offset: int = 0  # OPT: the position table has this many extra leading rows
    # How HF's forward numbers tokens without position_ids: from the attention mask (OPT), else 0..S-1.
    positions_from_mask: bool = False
    embed_dim: int | None = None  # token embedding width when it differs from hidden (OPT project_in/out)
    final_norm: bool = True  # False for post-norm stacks, whose blocks end normalized

    def __post_init__(self):
        check_choice("norm", self.norm, ("layer_norm", "rms_norm"))
        check_choice("block", self.block, BLOCK_KINDS)
        check_positive(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                       max_position_embeddings=self.max_position_embeddings, embed_dim=self.embed_dim)
        if self.num_layers < 0 or self.norm_eps < 0 or self.initializer_range < 0:
            raise ValueError(f"num_layers ({self.num_layers}), norm_eps ({self.norm_eps}) and initializer_range "
                             f"({self.initializer_range}) must be >= 0")
        check_probability(embed_dropout=self.embed_dropout_p, residual_dropout=self.residual_dropout_p)
        if self.final_norm == (self.block == "post_norm"):
            raise ValueError("post-norm blocks end normalized and take no final norm; every other block needs one")
        if not self.learned_positions and self.rope is None:
            raise ValueError("a decoder needs learned positions or a rotary config")
