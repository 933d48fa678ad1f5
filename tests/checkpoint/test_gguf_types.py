"""GGUF files of several tensor types, written from a random HF LLaMA: ours equals transformers' own GGUF
load of the same file (logits and config), tied and untied heads."""

import numpy as np
import pytest
import torch
import transformers

import flash_models as fm
from flash_models.checkpoint.gguf_file import permute_rotary
from flash_models.testing import random_hf_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path, hf, matrix_type):
    """``hf`` as llama.cpp's converter writes it: Q/K rows permuted, 2-D weights stored as ``matrix_type``, rope
    scaling (linear, yarn) in the metadata."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    rope = c.rope_parameters
    if rope["rope_type"] != "default":
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"])), w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2"), w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size), w.add_token_merges([])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(5)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    names.update({f"model.layers.{i}.{hf_name}.weight": f"blk.{i}.{name}.weight"
                  for i in range(c.num_hidden_layers) for hf_name, name in LAYER_NAMES.items()})
    for key, tensor in hf.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if "q_proj" in key or "k_proj" in key:
            tensor = permute_rotary(tensor, c.num_attention_heads if "q_proj" in key else c.num_key_value_heads)
        array = tensor.float().numpy()
        if array.ndim == 1 or matrix_type == Q.F32:
            w.add_tensor(names[key], array)
        elif matrix_type == Q.F16:
            w.add_tensor(names[key], array.astype(np.float16))
        else:
            raw = gguf.quants.quantize(array, matrix_type)
            w.add_tensor(names[key], raw, raw_shape=raw.shape, raw_dtype=matrix_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("matrix_type", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_1], ids=lambda t: t.name)
def test_gguf_tensor_types_match_transformers_gguf_load(tmp_path, matrix_type, tied):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, tie_word_embeddings=tied)
    hf = random_hf_model(config, seed=5)
    write_gguf(tmp_path / "m.gguf", hf, matrix_type)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4
    assert ours.config.tie_word_embeddings == theirs.config.tie_word_embeddings == tied
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(ours.config, name) == getattr(theirs.config, name), name


def test_gguf_file_in_a_subfolder_and_loading_arguments(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = random_hf_model(config, seed=6)
    (tmp_path / "sub").mkdir()
    write_gguf(tmp_path / "sub" / "m.gguf", hf, Q.F32)
    ids = torch.randint(0, 64, (1, 7))
    model = fm.from_pretrained(tmp_path, gguf_file="m.gguf", subfolder="sub", device_map="cpu", dtype="auto")
    assert model.dtype == torch.float32  # a GGUF file dequantizes to float32
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="use_safetensors=True with a GGUF file"):
        fm.from_pretrained(tmp_path / "sub" / "m.gguf", use_safetensors=True)
    with pytest.raises(ValueError, match="config is a gpt2 config, but the GGUF file holds a llama model"):
        fm.from_pretrained(tmp_path / "sub" / "m.gguf", config=transformers.GPT2Config())
    with pytest.raises(ValueError, match="subfolder='sub' with a .gguf path"):
        fm.from_pretrained(tmp_path / "sub" / "m.gguf", subfolder="sub")


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                  {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 16}], ids=lambda r: r["rope_type"])
def test_gguf_rope_scaling_is_applied(tmp_path, rope):
    """llama.cpp applies the file's rope scaling; so do we (transformers' GGUF loader drops it: its logits are of
    unscaled rotary, so the reference here is the HF model built with the same scaling)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_parameters=rope)
    hf = random_hf_model(config, seed=7)
    write_gguf(tmp_path / "m.gguf", hf, Q.F32)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    read = ours.config.to_hf().rope_parameters
    assert {key: read[key] for key in rope} == rope
    ids = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
