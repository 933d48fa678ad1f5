"""Checkpoint rules of the decoder-only LMs (HF layout <-> ours), one function per ``model_type``."""

from __future__ import annotations

from ..remap import IDENTITY, TRANSPOSE, Rule, RuleSet, Transform, concat


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
    qkv_bias, out_bias = config.attention_biases()  # Qwen2: bias on q/k/v only
    if qkv_bias:
        attn["attn.qkv.bias"] = (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), concat(qkv_sizes))
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


def _heads_interleaved_qkv(num_heads: int) -> Transform:
    """GPT-NeoX fuses qkv per head, rows ordered (head, [q k v], dim); ours are ([q k v], head, dim)."""

    def to_ours(parts):
        w = parts[0]
        return w.reshape(num_heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()

    def to_hf(t):
        return [t.reshape(3, num_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()]

    return Transform(f"neox_qkv(heads={num_heads})", to_ours, to_hf)


def _linears(pairs: dict[str, str], *, bias: bool, transform: Transform = IDENTITY) -> dict:
    out = {}
    for ours, hf in pairs.items():
        out[f"{ours}.weight"] = ((f"{hf}.weight",), transform)
        if bias:
            out[f"{ours}.bias"] = ((f"{hf}.bias",), IDENTITY)
    return out


def _norms(pairs: dict[str, str], *, bias: bool = True) -> dict:
    return {f"{ours}.{w}": ((f"{hf}.{w}",), IDENTITY) for ours, hf in pairs.items() for w in (("weight", "bias") if bias else ("weight",))}


def _head(config, rules: list[Rule], ignore: list[str], *, bias: bool = False) -> None:
    if config.tie_word_embeddings:
        ignore.append(r"lm_head\.weight")
    else:
        rules.append(Rule("lm_head.weight", "lm_head.weight"))
        if bias:
            rules.append(Rule("lm_head.bias", "lm_head.bias"))


def gpt_neox_rules(config) -> RuleSet:
    p = "gpt_neox."
    qkv = _heads_interleaved_qkv(config.num_attention_heads)
    attn = {"attn.qkv.weight": (("attention.query_key_value.weight",), qkv)}
    if config.attention_bias:
        attn["attn.qkv.bias"] = (("attention.query_key_value.bias",), qkv)
    attn.update(_linears({"attn.out_proj": "attention.dense"}, bias=config.attention_bias))
    mlp = _linears({"mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h"}, bias=True)
    norms = _norms({"norm1": "input_layernorm", "norm2": "post_attention_layernorm"})
    rules = _decoder_body(p, "layers", attn=attn, mlp=mlp, norms=norms) + [
        Rule("embed.tokens.weight", f"{p}embed_in.weight"),
        Rule("norm_f.weight", f"{p}final_layer_norm.weight"),
        Rule("norm_f.bias", f"{p}final_layer_norm.bias"),
    ]
    ignore = [r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)", r"gpt_neox\.rotary_emb\.inv_freq"]
    _head(config, rules, ignore)
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",),
                   legacy_keys=((r"^embed_out\.weight$", "lm_head.weight"),))  # transformers < 5 named the head embed_out


def gptj_rules(config) -> RuleSet:
    p = "transformer."
    attn = _linears({"attn.out_proj": "attn.out_proj"}, bias=False)
    attn["attn.qkv.weight"] = (("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"), concat((config.n_embd,) * 3))
    mlp = _linears({"mlp.fc1": "mlp.fc_in", "mlp.fc2": "mlp.fc_out"}, bias=True)
    rules = _decoder_body(p, "h", attn=attn, mlp=mlp, norms=_norms({"norm1": "ln_1"})) + [
        Rule("embed.tokens.weight", f"{p}wte.weight"),
        Rule("norm_f.weight", f"{p}ln_f.weight"),
        Rule("norm_f.bias", f"{p}ln_f.bias"),
        Rule("lm_head.weight", "lm_head.weight"),
        Rule("lm_head.bias", "lm_head.bias"),
    ]
    ignore = [r"transformer\.h\.\d+\.attn\.(bias|masked_bias|embed_positions)"]
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix=p, head_prefixes=("lm_head.",))


def opt_rules(config) -> RuleSet:
    p = "model.decoder."
    h, bias = config.hidden_size, config.enable_bias
    attn = {"attn.qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), concat((h,) * 3))}
    if bias:
        attn["attn.qkv.bias"] = (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), concat((h,) * 3))
    attn.update(_linears({"attn.out_proj": "self_attn.out_proj"}, bias=bias))
    mlp = _linears({"mlp.fc1": "fc1", "mlp.fc2": "fc2"}, bias=bias)
    norms = _norms({"norm1": "self_attn_layer_norm", "norm2": "final_layer_norm"})
    rules = _decoder_body(p, "layers", attn=attn, mlp=mlp, norms=norms) + [
        Rule("embed.tokens.weight", f"{p}embed_tokens.weight"),
        Rule("embed.positions.weight", f"{p}embed_positions.weight"),
    ]
    if config.do_layer_norm_before:
        rules += [Rule("norm_f.weight", f"{p}final_layer_norm.weight"), Rule("norm_f.bias", f"{p}final_layer_norm.bias")]
    if config.word_embed_proj_dim != h:
        rules += [Rule("embed.project_in.weight", f"{p}project_in.weight"), Rule("project_out.weight", f"{p}project_out.weight")]
    ignore: list[str] = []
    _head(config, rules, ignore)
    return RuleSet(tuple(rules), ignore=tuple(ignore), base_prefix="model.", head_prefixes=("lm_head.",))
