"""GGUF files of several tensor types and architectures (llama, qwen2, qwen3, phi3, gemma, gemma2, gpt2), written from random HF models:
ours equals transformers' own GGUF load of the same file (logits and config), tied and untied heads."""

import math

import numpy as np
import pytest
import torch
import transformers

import flash_models as fm
from flash_models.checkpoint.gguf_file import permute_rotary
from flash_models.compare import load_hf
from flash_models.testing import random_hf_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # (the last two: Phi-3's fused ones)
# Gemma 2's: its post_attention_layernorm normalizes the attention's output, and ffn_norm is the one before the MLP.
GEMMA2_LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(path, hf, matrix_type, *, vocabulary=True, extra_tensors=None):
    """``hf`` as llama.cpp's converter writes it: a LLaMA's Q/K rows permuted, 2-D weights stored as
    ``matrix_type``, rope scaling (linear, yarn) and the head dim in the metadata; ``vocabulary=False`` leaves
    the tokenizer's tokens out (the special token ids stay), ``extra_tensors`` (name -> array) are added."""
    c = hf.config
    arch = c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    rope = c.rope_parameters
    if rope["rope_type"] == "longrope":  # as llama.cpp writes Phi-3's: the factors as tensors, no scaling type
        original = rope["original_max_position_embeddings"]
        factor = c.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
        extra_tensors = {**(extra_tensors or {}), **{f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], np.float32)
                                                     for kind in ("long", "short")}}
    elif rope["rope_type"] != "default":
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"])), w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch != "phi3":  # llama.cpp's Phi-3 converter writes no head dim: hidden / heads
        w.add_key_length(head_dim), w.add_value_length(head_dim)
    if getattr(c, "sliding_window", None) is not None:
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping), w.add_final_logit_softcapping(c.final_logit_softcapping)
    if vocabulary:
        w.add_tokenizer_model("gpt2"), w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        w.add_token_types([1] * c.vocab_size), w.add_token_merges([])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(5)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {**LAYER_NAMES, **GEMMA2_LAYER_NAMES} if arch == "gemma2" else LAYER_NAMES
    names.update({f"model.layers.{i}.{hf_name}.{kind}": f"blk.{i}.{name}.{kind}" for kind in ("weight", "bias")
                  for i in range(c.num_hidden_layers) for hf_name, name in layer_names.items()})
    for key, tensor in hf.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "llama" and ("q_proj" in key or "k_proj" in key):
            tensor = permute_rotary(tensor, c.num_attention_heads if "q_proj" in key else c.num_key_value_heads)
        if arch in ("gemma", "gemma2") and key.endswith("norm.weight"):  # llama.cpp's Gemma converters: 1 + weight
            tensor = tensor + 1
        add_tensor(w, names[key], tensor.float().numpy(), matrix_type)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def add_tensor(w, name, array, matrix_type):
    """A vector as float32; a matrix as ``matrix_type``."""
    if array.ndim == 1 or matrix_type == Q.F32:
        w.add_tensor(name, array)
    elif matrix_type == Q.F16:
        w.add_tensor(name, array.astype(np.float16))
    else:
        raw = gguf.quants.quantize(array, matrix_type)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=matrix_type)


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


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_gguf_architectures_with_biases_and_head_norms(tmp_path, arch, tied):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k head norms, a head dim that is not hidden / heads): llama.cpp keeps
    their Q/K rows in HF's order, so a LLaMA's un-permuting would scramble them; ours equals the source model
    and transformers' GGUF load. A LLaMA with biases: its q/k bias entries are permuted as its rows; ours
    equals the source model (transformers' GGUF load drops a LLaMA's biases, so it is no reference there)."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, attention_bias=True)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
    else:  # transformers' GGUF loader keeps Qwen3Config's default head dim (128), as real Qwen3 files have it
        config = transformers.Qwen3Config(**common, head_dim=128)
    hf = random_hf_model(config, seed=7)
    write_gguf(tmp_path / "m.gguf", hf, Q.F32)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    assert ours.config.model_type == arch
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    expected = hf.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(ours.generate(ids[:1], max_new_tokens=5, do_sample=False), expected)
    if arch != "llama":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
        with torch.no_grad():
            assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4


GPT2_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def write_gpt2_gguf(path, hf, matrix_type):
    """A GPT-2 as llama.cpp's converter writes it: the Conv1D weights transposed to (out, in)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(c.n_layer), w.add_context_length(c.n_positions), w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(c.n_inner or 4 * c.n_embd), w.add_head_count(c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_tokenizer_model("gpt2"), w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size), w.add_token_merges([]), w.add_bos_token_id(1), w.add_eos_token_id(2)
    names = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
             "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
             "lm_head.weight": "output.weight"}
    names.update({f"transformer.h.{i}.{hf_name}.{kind}": f"blk.{i}.{name}.{kind}" for kind in ("weight", "bias")
                  for i in range(c.n_layer) for hf_name, name in GPT2_NAMES.items()})
    for key, tensor in hf.state_dict().items():
        if key not in names or (key == "lm_head.weight" and c.tie_word_embeddings):
            continue  # (the causal-mask buffers)
        array = tensor.float().numpy()
        if array.ndim == 2 and key.startswith("transformer.h."):
            array = np.ascontiguousarray(array.T)
        add_tensor(w, names[key], array, matrix_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shape", ["default", "odd"])
def test_gpt2_gguf_matches_the_source_and_transformers_gguf_load(tmp_path, tied, shape):
    """GPT-2's default context and MLP width, and odd ones: transformers' GGUF load reads neither from the file
    (it keeps GPT2Config's 1024 and 4 * n_embd), so it is a reference only for the default ones."""
    sizes = dict(n_positions=1024, n_inner=None) if shape == "default" else dict(n_positions=32, n_inner=96)
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, tie_word_embeddings=tied, **sizes)
    hf = random_hf_model(config, seed=3)
    write_gpt2_gguf(tmp_path / "m.gguf", hf, Q.F32)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    assert ours.config.model_type == "gpt2" and ours.config.tie_word_embeddings == tied
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    assert torch.equal(ours.generate(ids[:1], max_new_tokens=5, do_sample=False),
                       hf.generate(ids[:1], max_new_tokens=5, do_sample=False))
    if shape == "default":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
        with torch.no_grad():
            assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4
    write_gpt2_gguf(tmp_path / "q.gguf", hf, Q.Q8_0)
    with torch.no_grad():  # quantized projections, transposed as the F32 ones
        assert (fm.from_pretrained(tmp_path / "q.gguf")(ids).logits - hf(ids).logits).abs().max().item() < 0.05


@pytest.mark.parametrize("tied", [True, False])
def test_phi3_gguf_matches_the_source_and_transformers_gguf_load(tmp_path, tied):
    """llama.cpp's phi3: fused attn_qkv and ffn_up, rows as HF holds them. Ours equals the source model with a
    window and half of each head rotating, and transformers' GGUF load on a config it reads whole (it drops the
    window and the rotary dimension count)."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=64,
                  tie_word_embeddings=tied, pad_token_id=5)
    ids = torch.randint(0, 96, (2, 13))
    for name, extra in (("whole", {}), ("window", dict(sliding_window=5, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))):
        hf = random_hf_model(transformers.Phi3Config(**common, **extra), seed=9)
        write_gguf(tmp_path / f"{name}.gguf", hf, Q.F32)
        ours = fm.from_pretrained(tmp_path / f"{name}.gguf")
        assert ours.config.model_type == "phi3" and ours.decoder_config.attention.sliding_window == extra.get("sliding_window")
        assert ours.decoder_config.rope.rotary_dim == (8 if extra else 16)
        with torch.no_grad():
            assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4, name
        if not extra:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"{name}.gguf").eval()
            with torch.no_grad():
                assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4


def test_phi3_longrope_gguf_matches_the_source_past_the_original_length(tmp_path):
    """Phi-3-128k's files: LongRoPE's factors as tensors, the original length and attention factor in the
    metadata. Ours equals the source model on both sides of the original length (16), and generates its tokens
    across it (transformers' GGUF loader reads no LongRoPE: no reference there)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}
    config = transformers.Phi3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64,
                                     original_max_position_embeddings=16, rope_parameters=rope, pad_token_id=5)
    hf = random_hf_model(config, seed=10)
    write_gguf(tmp_path / "m.gguf", hf, Q.F32)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    got = ours.decoder_config.rope
    assert (got.rope_type, got.original_length, got.long_factor) == ("longrope", 16, tuple(rope["long_factor"]))
    for length in (11, 30):
        ids = torch.randint(0, 96, (2, length))
        with torch.no_grad():
            assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4, length
    prompt = torch.randint(2, 96, (1, 12))
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, max_new_tokens=10, eos_token_id=[]), expected)


@pytest.mark.parametrize("matrix_type", [Q.F32, Q.Q8_0], ids=lambda t: t.name)
def test_gemma_gguf_matches_the_source(tmp_path, matrix_type):
    """llama.cpp's gemma: the LLaMA names, rows as HF holds them, the head dim in key_length, each norm stored
    as 1 + weight. Ours equals the source model (transformers' GGUF loader reads no gemma file to compare with)."""
    config = transformers.GemmaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, pad_token_id=5)
    hf = random_hf_model(config, seed=9)  # norm weights around 0: stored around 1
    write_gguf(tmp_path / "m.gguf", hf, matrix_type)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    assert ours.config.model_type == "gemma" and ours.decoder_config.attention.head_dim == 16 and ours.head_is_tied()
    torch.testing.assert_close(ours.norm_f.weight, hf.model.norm.weight, rtol=0, atol=1e-6)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        err = (ours(ids).logits - hf(ids).logits).abs().max().item()
    assert err < (1e-4 if matrix_type == Q.F32 else 0.05), err
    if matrix_type == Q.F32:
        expected = hf.generate(ids[:1], max_new_tokens=5, do_sample=False)
        assert torch.equal(ours.generate(ids[:1], max_new_tokens=5, do_sample=False), expected)


def test_gemma2_gguf_matches_the_source_and_transformers_gguf_load(tmp_path):
    """llama.cpp's gemma2: four norms a block (each stored as 1 + weight), the soft-caps and the window in the
    metadata, the score scale from the head dim. Ours equals the source model, and so does ``flash-models
    compare``'s transformers side (transformers' GGUF loader alone keeps its config's default caps and scale)."""
    config = transformers.Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=5, query_pre_attn_scalar=16,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=5)
    hf = random_hf_model(config, seed=10, attn_implementation="eager")
    write_gguf(tmp_path / "m.gguf", hf, Q.F32)
    ours = fm.from_pretrained(tmp_path / "m.gguf")
    assert ours.config.model_type == "gemma2" and ours.decoder_config.final_logit_softcap == 3.0
    assert ours.decoder_config.attention.softcap == 2.0 and ours.decoder_config.attention.sliding_window == 5
    theirs = load_hf(str(tmp_path / "m.gguf"), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 96, (2, 13))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
        assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4
    expected = hf.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(ids[:1], max_new_tokens=6, do_sample=False), expected)


def test_an_unsupported_gguf_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    w.add_block_count(1), w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported; supported: .*qwen3.*phi3.*gpt2"):
        fm.from_pretrained(tmp_path / "m.gguf")


@pytest.mark.parametrize("arch", ["qwen3", "gpt2", "llama", "phi3"])
def test_compare_reference_reads_what_transformers_gguf_loader_drops(tmp_path, arch):
    """``flash-models compare``'s transformers side of a GGUF file: transformers' loader keeps a Qwen3's default
    head dim (128), GPT-2's default context and MLP width, no rope scaling, and no Phi-3 window or partial rotary,
    so such files failed to load there (size mismatch) or ran another model; with the file's architecture given,
    it equals the source model."""
    if arch == "phi3":
        config = transformers.Phi3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=64, sliding_window=7,
                                         pad_token_id=5, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                          "partial_rotary_factor": 0.5})
    elif arch == "qwen3":
        config = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                                          max_position_embeddings=64)
    elif arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=1, n_head=4, n_positions=32, n_inner=96)
    else:
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    hf = random_hf_model(config, seed=int(torch.randint(0, 1000, ()).item()))
    (write_gpt2_gguf if arch == "gpt2" else write_gguf)(tmp_path / "m.gguf", hf, Q.F32)
    reference = load_hf(str(tmp_path / "m.gguf"), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 96, (2, 30))
    with torch.no_grad():
        assert (reference(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
