"""Per-family checkpoint rules (HF layout <-> ours), one function per ``model_type``, built from our config."""

from __future__ import annotations

from typing import Callable

from .remap import IDENTITY, TRANSPOSE, Rule, RuleSet, concat


def _decoder_body(prefix: str, layer: str, *, attn: dict, mlp: dict, norms: dict) -> list[Rule]:
    """Rules for one family's block: maps of our sub-key -> (HF sub-keys, transform)."""
    rules = []
    for ours, (hf_parts, transform) in {**attn, **mlp, **norms}.items():
        rules.append(Rule(f"blocks.{{layer}}.{ours}", tuple(f"{prefix}{layer}.{{layer}}.{p}" for p in hf_parts), transform))
    return rules


def gpt2_rules(config) -> RuleSet:
    p = "transformer."
    linear = {}
    for ours, hf in {"attn.qkv": "attn.c_attn", "attn.out_proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}.items():
        linear[f"{ours}.weight"] = ((f"{hf}.weight",), TRANSPOSE)
        linear[f"{ours}.bias"] = ((f"{hf}.bias",), IDENTITY)
    norms = {f"norm{i}.{w}": ((f"ln_{i}.{w}",), IDENTITY) for i in (1, 2) for w in ("weight", "bias")}
    rules = _decoder_body(p, "h", attn=linear, mlp={}, norms=norms) + [
        Rule("embed.tokens.weight", f"{p}wte.weight"),
        Rule("embed.positions.weight", f"{p}wpe.weight"),
        Rule("norm_f.weight", f"{p}ln_f.weight"),
        Rule("norm_f.bias", f"{p}ln_f.bias"),
    ]
    ignore = [r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"]
    if config.tie_word_embeddings:
        ignore.append(r"lm_head\.weight")
    else:
        rules.append(Rule("lm_head.weight", "lm_head.weight"))
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",))


def llama_rules(config) -> RuleSet:
    p = "model."
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv_sizes = (hq * d, hkv * d, hkv * d)
    qkv = {"attn.qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), concat(qkv_sizes))}
    attn = {**qkv, "attn.out_proj.weight": (("self_attn.o_proj.weight",), IDENTITY)}
    if config.attention_bias:
        attn["attn.qkv.bias"] = (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), concat(qkv_sizes))
        attn["attn.out_proj.bias"] = (("self_attn.o_proj.bias",), IDENTITY)
    inter = config.intermediate_size
    mlp = {
        "mlp.gate_up.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), concat((inter, inter))),
        "mlp.down.weight": (("mlp.down_proj.weight",), IDENTITY),
    }
    if config.mlp_bias:
        mlp["mlp.gate_up.bias"] = (("mlp.gate_proj.bias", "mlp.up_proj.bias"), concat((inter, inter)))
        mlp["mlp.down.bias"] = (("mlp.down_proj.bias",), IDENTITY)
    norms = {"norm1.weight": (("input_layernorm.weight",), IDENTITY), "norm2.weight": (("post_attention_layernorm.weight",), IDENTITY)}
    rules = _decoder_body(p, "layers", attn=attn, mlp=mlp, norms=norms) + [
        Rule("embed.tokens.weight", f"{p}embed_tokens.weight"),
        Rule("norm_f.weight", f"{p}norm.weight"),
    ]
    ignore = [r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq"]
    if config.tie_word_embeddings:
        ignore.append(r"lm_head\.weight")
    else:
        rules.append(Rule("lm_head.weight", "lm_head.weight"))
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",))


RULES: dict[str, Callable[[object], RuleSet]] = {
    "gpt2": gpt2_rules,
    "llama": llama_rules,
}


def rules_for(config) -> RuleSet:
    try:
        return RULES[config.model_type](config)
    except KeyError:
        raise ValueError(f"no checkpoint rules for model_type {config.model_type!r}; known: {sorted(RULES)}") from None
