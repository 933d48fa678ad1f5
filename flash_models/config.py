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
# Other names transformers gives the same functions (its ACT2FN): "swish" is SiLU, "gelu_python" the exact GELU
# written out, "gelu_fast" the tanh approximation written out (equal to gelu_new within float rounding).
ACTIVATION_ALIASES = {"swish": "silu", "gelu_python": "gelu", "gelu_fast": "gelu_new"}
# Where a checkpoint's config sets how many channels of a head rotate.
ROTARY_DIM_FIELDS = "the config's rotary_dim, or head_dim x partial_rotary_factor (rotary_pct)"
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Block variants (modules/block.py): pre-norm (GPT-2, LLaMA), parallel attention + MLP with two norms (GPT-NeoX)
# or one shared norm (GPT-J), and post-norm (BERT, OPT-350m).
BLOCK_KINDS = ("pre_norm", "sandwich", "parallel", "parallel_shared_norm", "post_norm")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {choices}")


def activation_name(name: str) -> str:
    """Our name for a checkpoint's activation function (its ``hidden_act`` / ``activation_function``)."""
    name = ACTIVATION_ALIASES.get(name, name)
    if name not in ACTIVATIONS:
        raise ValueError(f"activation function {name!r} (the config's hidden_act / activation_function) is not "
                         f"supported; supported: {ACTIVATIONS + tuple(ACTIVATION_ALIASES)}")
    return name


# What a config may ask for. A config.json is untrusted input, and JSON integers have no size limit: these are
# checked on the raw fields, before anything is built or allocated.
# - Every integer anywhere must fit in int64 (what torch and the kernels' arguments hold).
# - A model dimension must fit in int32: the kernels index rows, vocabularies and positions in int32.
# - The number of layers is bounded by 10x the deepest transformer published (DeepNet, 1000 layers): even on the
#   meta device a layer takes about a millisecond to build, so 10**8 layers would hang the loader.
# - The parameters those sizes imply (an upper estimate: embeddings, and per layer 4 h^2 for attention and
#   3 h x intermediate for a gated MLP) are bounded by 10**13, 20 TB in bfloat16, far beyond any checkpoint; with
#   every size in int32, a single weight's element count could otherwise overflow int64.
MAX_INT = 2**63 - 1
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 10_000
MAX_PARAMETERS = 10**13
# Model dimensions under every supported family's HF spelling (GPT-2 and GPT-J: n_*; OPT: ffn_dim, ...).
WIDTH_FIELDS = ("hidden_size", "n_embd", "d_model")
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
INTERMEDIATE_FIELDS = ("intermediate_size", "n_inner", "ffn_dim")
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx")
SIZE_FIELDS = (*WIDTH_FIELDS, *LAYER_FIELDS, *INTERMEDIATE_FIELDS, *POSITION_FIELDS, "vocab_size",
               "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "rotary_dim",
               "word_embed_proj_dim", "type_vocab_size", "image_size", "patch_size", "num_channels")


def check_numbers(fields: dict, prefix: str = "") -> None:
    """Refuse NaN and infinity anywhere in a config's fields (nested dicts and lists too): JSON's 1e999 reads
    as inf, and a non-finite epsilon, theta or scale gives a model that computes nothing but NaN. Refuse
    integers beyond int64 too (JSON reads 10**30 as a Python int; torch would fail on it deep inside)."""
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            check_numbers(value, prefix=name + ".")
        elif isinstance(value, (list, tuple)):
            check_numbers({f"[{i}]": v for i, v in enumerate(value)}, prefix=name)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config value {name}={value} is not a finite number")
        elif isinstance(value, int) and not -MAX_INT - 1 <= value <= MAX_INT:
            raise ValueError(f"config value {name}={value} does not fit in a 64-bit integer")


def check_model_size(fields: dict) -> None:
    """Refuse model sizes no machine could hold, before anything is built (see MAX_SIZE, MAX_LAYERS and
    MAX_PARAMETERS): ``fields`` are an HF config's, under the family's own names."""
    sizes = {name: fields[name] for name in SIZE_FIELDS if isinstance(fields.get(name), int)}
    for name, value in sizes.items():
        limit = MAX_LAYERS if name in LAYER_FIELDS else MAX_SIZE
        if value > limit:
            raise ValueError(f"config value {name}={value} is too large: at most {limit} "
                             f"({'layers' if name in LAYER_FIELDS else 'an int32 dimension'})")

    def first(names, default=0):
        return next((sizes[n] for n in names if n in sizes), default)

    width = first(WIDTH_FIELDS)
    per_layer = 4 * width * width + 3 * width * first(INTERMEDIATE_FIELDS, 4 * width)
    embeddings = (sizes.get("vocab_size", 0) + first(POSITION_FIELDS)) * width
    parameters = embeddings + first(LAYER_FIELDS) * per_layer
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"the config's sizes ({', '.join(f'{k}={v}' for k, v in sizes.items())}) imply about "
                         f"{parameters:.3g} parameters, more than the {MAX_PARAMETERS:.0e} any checkpoint could hold")


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


def check_pad_token_id(pad_token_id: int | None, vocab_size: int) -> None:
    """A pad id that is the token embedding's padding row (HF's nn.Embedding padding_idx) must be a token:
    in [-vocab_size, vocab_size), negative counting from the end (None: no padding row)."""
    if pad_token_id is not None and not -vocab_size <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary of {vocab_size} tokens (the token "
                         "embedding's padding row, as in HF); set it to a token id of the vocabulary or to null")


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
    attention_factor: float | None = None  # yarn, longrope
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    # longrope: a divisor per frequency, the short ones for sequences up to original_max_position_embeddings
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        check_numbers({k: v for k, v in vars(self).items() if isinstance(v, (float, tuple))}, prefix="rope.")
        check_positive(rope_theta=self.theta, rope_factor=self.factor,
                       max_position_embeddings=self.max_position_embeddings)
        if self.rotary_dim % 2 or self.rotary_dim < 0:
            raise ValueError(f"rotary_dim (the rotated channels of a head: {ROTARY_DIM_FIELDS}) must be even and "
                             f">= 0, got {self.rotary_dim}")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(self, name)
                if factors is None or len(factors) != self.rotary_dim // 2:
                    raise ValueError(f"longrope rope_parameters.{name} must hold rotary_dim / 2 = "
                                     f"{self.rotary_dim // 2} numbers, got {factors}")

    @property
    def original_length(self) -> int:
        """The length the frequencies were trained for, which the scaling rules extend."""
        return self.original_max_position_embeddings or self.max_position_embeddings

    def length_dependent(self, length: int) -> bool:
        """Whether sequences of up to ``length`` positions rotate with frequencies that depend on the length:
        dynamic NTK past ``max_position_embeddings``, LongRoPE's long factors past the original length. Such
        tables are built per length, never once for a whole generation."""
        if self.rope_type == "dynamic":
            return length > self.max_position_embeddings
        return self.rope_type == "longrope" and length > self.original_length

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
            "partial_rotary_factor", "short_factor", "long_factor",
        }
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"rope_parameters has keys flash-models does not support: {sorted(unknown)}")
        kwargs = {k: params[k] for k in known - {"rope_theta", "partial_rotary_factor"} if params.get(k) is not None}
        for name in ("short_factor", "long_factor"):
            if name in kwargs:
                kwargs[name] = tuple(float(f) for f in kwargs[name])
        if rope_type == "longrope" and "factor" not in kwargs and "original_max_position_embeddings" in kwargs:
            # HF's default: how far max_position_embeddings extends the original length (Phi-3's configs)
            kwargs["factor"] = max_position_embeddings / kwargs["original_max_position_embeddings"]
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
            for key in ("mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    params[key] = getattr(self, key)
        if self.rope_type == "longrope":
            params.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor))
        if self.rope_type in ("yarn", "longrope") and self.attention_factor is not None:
            params["attention_factor"] = self.attention_factor
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
    softcap: float | None = None  # Gemma 2: scores soft-capped to softcap * tanh(scores / softcap) before the softmax

    def __post_init__(self):
        check_positive(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                       num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                       softmax_scale=self.softmax_scale, sliding_window=self.sliding_window, softcap=self.softcap)
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
    activation: str  # one of ACTIVATIONS; an alias (ACTIVATION_ALIASES) is replaced by the name it stands for
    gated: bool = False
    bias: bool = True
    dropout_p: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "activation", activation_name(self.activation))
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
    # Norm weights stored as offsets from one, the norms scaling by 1 + weight (Gemma's RMSNorm).
    norm_zero_centered: bool = False
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
    # Token embeddings multiplied by this, rounded to the table's dtype (Gemma: sqrt(hidden_size)); None: not scaled.
    embed_scale: float | None = None
    # Logits soft-capped to cap * tanh(logits / cap) (Gemma 2), in the output, the loss and generation; None: not.
    final_logit_softcap: float | None = None
    # HF's nn.Embedding(padding_idx=pad_token_id) (LLaMA, Mistral, Qwen, OPT): the pad token's row gets no gradient
    # (and is zero in a fresh model); negative counts from the end of the vocabulary, as in torch.
    padding_idx: int | None = None
    final_norm: bool = True  # False for post-norm stacks, whose blocks end normalized
    # Layers that attend to every earlier key although ``attention`` has a sliding window (Qwen2's layers below
    # max_window_layers); empty: the window, if any, applies to every layer.
    full_attention_layers: tuple[int, ...] = ()
    # Generation recomputes the whole KV cache once a sequence passes LongRoPE's original length (HF's Phi-3
    # generate does; its LLaMA keeps the keys cached before the switch as they were rotated).
    recompute_cache_at_rope_switch: bool = False

    def __post_init__(self):
        check_choice("norm", self.norm, ("layer_norm", "rms_norm"))
        check_choice("block", self.block, BLOCK_KINDS)
        check_positive(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                       max_position_embeddings=self.max_position_embeddings, embed_dim=self.embed_dim,
                       embed_scale=self.embed_scale, final_logit_softcap=self.final_logit_softcap)
        if self.num_layers < 0 or self.norm_eps < 0 or self.initializer_range < 0:
            raise ValueError(f"num_layers ({self.num_layers}), norm_eps ({self.norm_eps}) and initializer_range "
                             f"({self.initializer_range}) must be >= 0")
        check_probability(embed_dropout=self.embed_dropout_p, residual_dropout=self.residual_dropout_p)
        if self.final_norm == (self.block == "post_norm"):
            raise ValueError("post-norm blocks end normalized and take no final norm; every other block needs one")
        if not self.learned_positions and self.rope is None:
            raise ValueError("a decoder needs learned positions or a rotary config")
        if self.rope is not None and self.rope.rotary_dim > self.attention.head_dim:
            raise ValueError(f"rotary_dim {self.rope.rotary_dim} exceeds the head dim {self.attention.head_dim} "
                             f"({ROTARY_DIM_FIELDS})")
        check_pad_token_id(self.padding_idx, self.vocab_size)

    def cache_refill_length(self) -> int | None:
        """The length past which generation recomputes the whole KV cache (LongRoPE's original length, where
        ``recompute_cache_at_rope_switch``), or None where it never does."""
        rope = self.rope
        if self.recompute_cache_at_rope_switch and rope is not None and rope.rope_type == "longrope":
            return rope.original_length
        return None
