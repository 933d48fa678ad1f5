"""GGUF files (llama.cpp): metadata -> an HF config, tensors dequantized -> an HF-named state dict.

Seven architectures. Six share llama.cpp's LLaMA tensor names and HF's LLaMA module names:
- ``llama`` (LLaMA, and Mistral and SmolLM2, which llama.cpp writes as llama). llama.cpp's converter permutes
  the rows of the Q and K projections (it pairs rotary channels as interleaved, where HF pairs them
  half-split); ``unpermute_rotary`` undoes that so the weights match HF's.
- ``qwen2``: the LLaMA block with q/k/v biases. Its rows are written as HF has them (llama.cpp runs Qwen's
  rotary half-split), so nothing is permuted.
- ``qwen3``: Qwen2's block with an RMSNorm over each q and k head and a head dim of its own
  (``attention.key_length``), biases optional; rows as HF has them.
- ``phi3``: the LLaMA layout with fused ``attn_qkv`` and ``ffn_up`` ([gate; up]) as HF's Phi-3 holds them, rows
  unpermuted (llama.cpp runs its rotary half-split), part of each head rotating where ``rope.dimension_count``
  says so, an optional window, and LongRoPE (the 128k models) from its ``rope_factors_long/short`` tensors.
- ``gemma``: the LLaMA layout, rows as HF has them (llama.cpp runs its rotary half-split), the head dim in
  ``attention.key_length``; llama.cpp's converter stores each norm's weight plus one (the factor its RMSNorm
  multiplies by), which the loader takes back to HF's offsets.
- ``gemma2``: Gemma's, with four norms a block, the soft-caps and the window in the metadata.
And ``gpt2``, whose projections llama.cpp stores as (out, in) matrices where HF's Conv1D layers hold
(in, out): they are transposed back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .gguf_reader import GGUFFile

# GGUF tensor name -> HF name, for what every LLaMA-layout architecture shares.
_LLAMA_LAYOUT = {
    r"token_embd\.weight": "model.embed_tokens.weight",
    r"output_norm\.weight": "model.norm.weight",
    r"output\.weight": "lm_head.weight",
    r"blk\.(\d+)\.attn_norm\.weight": "model.layers.{}.input_layernorm.weight",
    r"blk\.(\d+)\.ffn_norm\.weight": "model.layers.{}.post_attention_layernorm.weight",
    r"blk\.(\d+)\.attn_output\.(weight|bias)": "model.layers.{}.self_attn.o_proj.{}",
    r"blk\.(\d+)\.ffn_down\.weight": "model.layers.{}.mlp.down_proj.weight",
}
# LLaMA's separate projections (and Qwen3's q/k norms).
_LLAMA_NAMES = {
    **_LLAMA_LAYOUT,
    r"blk\.(\d+)\.attn_q\.(weight|bias)": "model.layers.{}.self_attn.q_proj.{}",
    r"blk\.(\d+)\.attn_k\.(weight|bias)": "model.layers.{}.self_attn.k_proj.{}",
    r"blk\.(\d+)\.attn_v\.(weight|bias)": "model.layers.{}.self_attn.v_proj.{}",
    r"blk\.(\d+)\.attn_q_norm\.weight": "model.layers.{}.self_attn.q_norm.weight",
    r"blk\.(\d+)\.attn_k_norm\.weight": "model.layers.{}.self_attn.k_norm.weight",
    r"blk\.(\d+)\.ffn_gate\.weight": "model.layers.{}.mlp.gate_proj.weight",
    r"blk\.(\d+)\.ffn_up\.weight": "model.layers.{}.mlp.up_proj.weight",
}
# Gemma 2's four norms a block: llama.cpp's ffn_norm is the norm before the MLP there (HF's
# pre_feedforward_layernorm), and the outputs of the attention and the MLP have their own.
_GEMMA2_NAMES = {
    **_LLAMA_NAMES,
    r"blk\.(\d+)\.ffn_norm\.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
    r"blk\.(\d+)\.post_attention_norm\.weight": "model.layers.{}.post_attention_layernorm.weight",
    r"blk\.(\d+)\.post_ffw_norm\.weight": "model.layers.{}.post_feedforward_layernorm.weight",
}
# Phi-3's fused [q; k; v] and [gate; up] projections, as HF holds them.
_PHI3_NAMES = {
    **_LLAMA_LAYOUT,
    r"blk\.(\d+)\.attn_qkv\.weight": "model.layers.{}.self_attn.qkv_proj.weight",
    r"blk\.(\d+)\.ffn_up\.weight": "model.layers.{}.mlp.gate_up_proj.weight",
}
# GGUF tensor name -> HF GPT2LMHeadModel name.
_GPT2_NAMES = {
    r"token_embd\.weight": "transformer.wte.weight",
    r"position_embd\.weight": "transformer.wpe.weight",
    r"output_norm\.(weight|bias)": "transformer.ln_f.{}",
    r"output\.weight": "lm_head.weight",
    r"blk\.(\d+)\.attn_norm\.(weight|bias)": "transformer.h.{}.ln_1.{}",
    r"blk\.(\d+)\.attn_qkv\.(weight|bias)": "transformer.h.{}.attn.c_attn.{}",
    r"blk\.(\d+)\.attn_output\.(weight|bias)": "transformer.h.{}.attn.c_proj.{}",
    r"blk\.(\d+)\.ffn_norm\.(weight|bias)": "transformer.h.{}.ln_2.{}",
    r"blk\.(\d+)\.ffn_up\.(weight|bias)": "transformer.h.{}.mlp.c_fc.{}",
    r"blk\.(\d+)\.ffn_down\.(weight|bias)": "transformer.h.{}.mlp.c_proj.{}",
}


@dataclass(frozen=True)
class _Architecture:
    names: dict[str, str]  # GGUF tensor name pattern -> HF name template
    permuted_rotary: bool = False  # llama.cpp interleaved the Q/K rows (see the module docstring)
    conv1d_transposed: bool = False  # 2-D projection weights stored (out, in) for HF's (in, out) Conv1D
    norms_plus_one: bool = False  # norm weights stored as 1 + HF's weight (Gemma's zero-centered norms)


_ARCHITECTURES = {
    "llama": _Architecture(_LLAMA_NAMES, permuted_rotary=True),
    "qwen2": _Architecture(_LLAMA_NAMES),
    "qwen3": _Architecture(_LLAMA_NAMES),
    "phi3": _Architecture(_PHI3_NAMES),
    "gemma": _Architecture(_LLAMA_NAMES, norms_plus_one=True),
    "gemma2": _Architecture(_GEMMA2_NAMES, norms_plus_one=True),
    "gpt2": _Architecture(_GPT2_NAMES, conv1d_transposed=True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
# Tensors that are no weight: llama.cpp's precomputed Llama-3 frequencies (we compute our own), and LongRoPE's
# per-frequency factors (Phi-3's 128k models), which ``_phi3_config`` reads into the config.
_IGNORED = (r"rope_freqs\.weight", r"rope_factors_(long|short)\.weight")


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF half-split row order -> llama.cpp's interleaved order (what its converter does)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved row order -> HF's half-split order; the inverse of ``permute_rotary``."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_REQUIRED = object()


def _field(reader: GGUFFile, key: str, kind: type = object, default=_REQUIRED):
    """Metadata ``key`` checked to be a ``kind`` (int, float, str or list; bools are not numbers); a missing key
    takes ``default``, and without one it is a ValueError naming the file and the key, as is a value of another
    kind."""
    value = reader.fields.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{reader.path}: GGUF metadata {key} is missing; the file is incomplete or not a model")
    if value is None or value is default or kind is object:
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = {int: number and isinstance(value, int), float: number, str: isinstance(value, str),
            list: isinstance(value, list)}[kind]
    if not fits:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"{reader.path}: GGUF metadata {key} must be of type {kind.__name__}, got {shown}")
    return kind(value)


def hf_config_dict(reader) -> dict:
    """An HF config (as a dict for ``transformers.AutoConfig.for_model``) from GGUF metadata."""
    arch = _field(reader, "general.architecture", default=None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{reader.path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    a = lambda key, kind, default=_REQUIRED: _field(reader, f"{arch}.{key}", kind, default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    tensor_names = set(tensors)
    vocab = a("vocab_size", int, None)
    if vocab is None and "token_embd.weight" in tensors:  # the embedding's rows (GGUF lists dims fastest-first)
        vocab = int(tensors["token_embd.weight"].shape[-1])
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens", list))
    common = {
        "model_type": arch,
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", int, None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", int, None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", int, None),  # as transformers reads it
    }
    if arch == "gpt2":
        hidden = a("embedding_length", int)
        return {**common, "n_embd": hidden, "n_layer": a("block_count", int), "n_head": a("attention.head_count", int),
                "n_positions": a("context_length", int), "n_inner": a("feed_forward_length", int, 4 * hidden),
                "layer_norm_epsilon": a("attention.layer_norm_epsilon", float, 1e-5)}
    config = {**common, **_llama_style_config(a, tensor_names, arch)}
    if arch == "phi3":
        config.update(_phi3_config(a, config, tensors))
    if arch == "gemma2":
        config.update(_gemma2_config(a, config))
    return config


def _gemma2_config(a, config: dict) -> dict:
    """Gemma 2's fields over the LLaMA-style ones: the two soft-caps and the window llama.cpp writes, and the
    score scale it does not write, which llama.cpp takes as 1 / sqrt(head dim) except for the 27B model (46
    layers), whose scale is 1 / sqrt(hidden / heads): HF's query_pre_attn_scalar is that square."""
    scalar = (config["hidden_size"] // config["num_attention_heads"] if config["num_hidden_layers"] == 46
              else config["head_dim"])
    return {"attn_logit_softcapping": a("attn_logit_softcapping", float, None),
            "final_logit_softcapping": a("final_logit_softcapping", float, None),
            "sliding_window": a("attention.sliding_window", int, None), "query_pre_attn_scalar": scalar}


def _phi3_config(a, config: dict, tensors: dict) -> dict:
    """Phi-3's fields over the LLaMA-style ones: its head dim is hidden / heads, of which the rope's dimension
    count may rotate a part; an optional window; no bias switch (its projections have none); LongRoPE where the
    file holds its factors (the 128k models), with the original length and attention factor llama.cpp wrote."""
    config.pop("attention_bias")
    config.pop("head_dim")  # the LLaMA-style default is the rotated count, which for Phi-3 may be a part of it
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotated = a("rope.dimension_count", int, head_dim)
    original = a("rope.scaling.original_context_length", int, config["max_position_embeddings"])
    rope = dict(config["rope_parameters"])
    if "rope_factors_long.weight" in tensors:
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    **{f"{kind}_factor": _dequantize(tensors[f"rope_factors_{kind}.weight"]).flatten().tolist()
                       for kind in ("long", "short")})
        rope.pop("factor", None)  # HF's: max_position_embeddings / the original length
        attention_factor = a("rope.scaling.attn_factor", float, None)
        if attention_factor is not None:
            rope["attention_factor"] = attention_factor
    if rotated != head_dim:
        rope["partial_rotary_factor"] = rotated / head_dim
    return {"rope_parameters": rope, "sliding_window": a("attention.sliding_window", int, None),
            "original_max_position_embeddings": original}


def _llama_style_config(a, tensor_names: set[str], arch: str) -> dict:
    """The config fields of the LLaMA-style architectures; ``a(key, kind, default)`` reads ``{arch}.key``."""
    heads = a("attention.head_count", int)
    hidden = a("embedding_length", int)
    rope = {"rope_type": "default", "rope_theta": a("rope.freq_base", float, 10000.0)}
    scaling = a("rope.scaling.type", str, None)
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
        rope.update(rope_type=scaling, factor=a("rope.scaling.factor", float))
        original = a("rope.scaling.original_context_length", int, None)
        if original is not None and scaling == "yarn":  # linear scaling has no such parameter in transformers
            rope["original_max_position_embeddings"] = original
    rotary_dims = a("rope.dimension_count", int, hidden // heads if heads else 0)
    config = {
        "hidden_size": hidden,
        "intermediate_size": a("feed_forward_length", int),
        "num_hidden_layers": a("block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", int, heads),
        "head_dim": a("attention.key_length", int, rotary_dims),  # llama.cpp writes it where it is not hidden / heads
        "max_position_embeddings": a("context_length", int, 2048),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_parameters": rope,
    }
    if arch != "qwen2":  # Qwen2's q/k/v biases are part of its architecture; the others' are an option
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return config


def _known_name(name: str, arch: _Architecture) -> bool:
    return any(re.fullmatch(p, name) for p in (*arch.names, *_IGNORED))


def _hf_name(name: str, arch: _Architecture) -> str | None:
    for pattern, template in arch.names.items():
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups())
    if any(re.fullmatch(p, name) for p in _IGNORED):
        return None
    raise ValueError(f"GGUF tensor {name!r} has no HF counterpart known to flash-models")


def _dequantize(tensor) -> torch.Tensor:
    import gguf

    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a copy: GGUF data is memory-mapped


def check_tensor_types(reader: GGUFFile) -> None:
    """Every tensor's type must be one the ``gguf`` package dequantizes: each type is tried on one row up front,
    so an unsupported one is named (with its tensors) before minutes of dequantizing the rest."""
    import gguf

    tried: dict = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in tried:
            try:
                gguf.quants.dequantize(tensor.data[:1], tensor.tensor_type)
                tried[tensor.tensor_type] = True
            except NotImplementedError:
                tried[tensor.tensor_type] = False
    unsupported = sorted(t.name for t, ok in tried.items() if not ok)
    if unsupported:
        names = [t.name for t in reader.tensors if t.tensor_type.name in unsupported]
        raise ValueError(
            f"{reader.path}: tensor type(s) {', '.join(unsupported)} cannot be dequantized by the gguf package "
            f"(tensors {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); use a file quantized as F32, F16, "
            "BF16, Q8_0, Q4_0/Q4_1/Q5_0/Q5_1 or a K-quant"
        )


def gguf_hf_config(path: str | Path):
    """The file's architecture as a transformers config (checked as ``check_gguf`` checks it)."""
    import transformers

    _, config = check_gguf(path)
    config = dict(config)
    return transformers.AutoConfig.for_model(config.pop("model_type"), **config)


def check_gguf(path: str | Path) -> tuple[GGUFFile, dict]:
    """(reader, HF config dict) of a GGUF file checked for everything that can be wrong with it before a tensor
    is dequantized: a corrupt or truncated file, an unsupported architecture, missing metadata, a tensor type
    or a tensor name we cannot read. Each is a ValueError naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    reader = GGUFFile(path)
    config = hf_config_dict(reader)
    check_tensor_types(reader)
    arch = _ARCHITECTURES[config["model_type"]]
    unknown = [t.name for t in reader.tensors if not _known_name(t.name, arch)]
    if unknown:
        raise ValueError(f"{reader.path}: GGUF tensor(s) {', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''} "
                         f"have no counterpart in flash-models' {config['model_type']} model: the file holds a variant of "
                         "the architecture that flash-models does not read")
    return reader, config


def load_gguf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a GGUF file: (HF config dict, float32 state dict with HF's names and layouts: a LLaMA's Q/K rows
    un-permuted, GPT-2's projections transposed back to Conv1D's, a Gemma's norm weights less the one llama.cpp
    added)."""
    reader, config = check_gguf(path)
    arch = _ARCHITECTURES[config["model_type"]]
    permuted = {}
    if arch.permuted_rotary:
        permuted = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    state = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", disable=len(reader.tensors) < 64, leave=False):
        hf_name = _hf_name(tensor.name, arch)
        if hf_name is None:
            continue
        weight = _dequantize(tensor)
        projection = hf_name.split(".")[-2]
        if projection in permuted:  # its weight rows and bias entries alike
            weight = unpermute_rotary(weight, permuted[projection])
        if arch.conv1d_transposed and weight.dim() == 2 and projection in ("c_attn", "c_proj", "c_fc"):
            weight = weight.t().contiguous()
        if arch.norms_plus_one and hf_name.endswith("norm.weight"):
            weight = weight - 1.0
        state[hf_name] = weight
    return config, state
