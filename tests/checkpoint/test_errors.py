"""Bad input gets a clear error that names the problem."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

import flash_models as fm
from flash_models.checkpoint import CheckpointKeyError
from flash_models.testing import random_hf_model


def tiny_llama_dir(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    hf = random_hf_model(cfg)
    hf.save_pretrained(tmp_path)
    return hf


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match=r"model_type 't5' is not supported.*gpt2.*llama"):
        fm.from_pretrained(tmp_path)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointKeyError) as err:
        fm.from_pretrained(tmp_path)
    message = str(err.value)
    assert "missing keys (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected keys (1): model.layers.0.self_attn.q_norm.weight" in message


def test_shape_mismatch_names_expected_and_got(tmp_path):
    tiny_llama_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: expected \(64, 32\), got \(48, 32\)"):
        fm.from_pretrained(tmp_path)


def test_truncated_safetensors(tmp_path):
    tiny_llama_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fm.from_pretrained(tmp_path)


def test_truncated_gguf(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(fm.smollm2_gguf().read_bytes()[:100_000])
    with pytest.raises(ValueError, match="GGUF"):
        fm.from_pretrained(broken)


def test_folder_without_weights(tmp_path):
    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        fm.from_pretrained(tmp_path)


def test_input_longer_than_position_limit():
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=16)
    with pytest.raises(ValueError, match="exceeds the model's 16 positions"):
        model(torch.randint(0, 97, (1, 17)))
    with pytest.raises(ValueError, match="exceeds the model's 16 positions"):
        model.generate(torch.randint(0, 97, (1, 10)), max_new_tokens=7)


def test_token_ids_outside_vocab():
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=16)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 97\)"):
        model(torch.tensor([[1, 97]]))
    with pytest.raises(ValueError, match=r"a label is outside the vocabulary \[0, 97\).*first bad value: 500"):
        model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 500]]))


@pytest.mark.parametrize("preset, overrides", [
    ("gpt2", dict(n_layer=1, n_embd=32, n_head=4)),
    ("bert-base", dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=40)),
])
def test_empty_input_ids(preset, overrides):
    model = fm.create_model(preset, **overrides)
    with pytest.raises(ValueError, match="input_ids is empty: give at least one token"):
        model(torch.zeros(2, 0, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_token_ids_and_labels_of_a_non_integer_dtype(dtype):
    # torch's own errors (an embedding's, a gather's) would name neither input.
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=16)
    ids = torch.tensor([[1, 0, 1]])
    with pytest.raises(ValueError, match=rf"input_ids must lie in .*got a tensor of {dtype}: pass integer ids"):
        model(ids.to(dtype))
    for train in (True, False):  # the fused loss, and the loss over the logits
        with pytest.raises(ValueError, match=rf"labels must be integer class ids \(torch.long\), got .*{dtype}"):
            model.train(train)(ids, labels=ids.to(dtype))


@pytest.mark.parametrize("attn_impl", ["flash", "bogus"])
def test_explicit_attention_backend_that_cannot_run(attn_impl):
    # Our kernels take head dims up to 256 (FA2's limit): 2 heads over a width of 528 are 264 wide.
    with pytest.raises(ValueError, match="attn_impl"):
        fm.create_model("gpt2", n_layer=1, n_embd=528, n_head=2, vocab_size=97, attn_impl=attn_impl)


def test_explicit_triton_kernels_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = fm.create_model("llama-1b", num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=97, kernel_backend="triton")
    with pytest.raises(ValueError, match="backend='triton' cannot run on device 'cpu'"):
        model(torch.randint(0, 97, (1, 5)))


def test_bad_generation_arguments():
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=64)
    ids = torch.randint(0, 97, (1, 4))
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="top_p"):
        model.generate(ids, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(ids, eos_token_id=1000)


def write_tiny_llama_gguf(path, *, q_proj_type, metadata=None):
    """A one-layer LLaMA GGUF with random weights, its q projection stored as ``q_proj_type`` (raw bytes);
    ``metadata`` replaces (a value) or drops (None) entries of the LLaMA metadata, by key without the "llama."."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    fields = {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
              "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
              **(metadata or {})}
    for key, value in fields.items():
        if value is not None:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32 if isinstance(value, int)
             else writer.add_string if isinstance(value, str) else writer.add_array)(f"llama.{key}", value)
    writer.add_token_list([f"t{i}" for i in range(64)])
    shapes = {"token_embd.weight": (64, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.ffn_norm.weight": (32,), "blk.0.attn_k.weight": (16, 32), "blk.0.attn_v.weight": (16, 32),
              "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_gate.weight": (64, 32),
              "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    block, type_size = gguf.GGML_QUANT_SIZES[q_proj_type]
    raw = rng.integers(0, 256, (32, 32 // block * type_size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=q_proj_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("metadata, problem", [
    ({"attention.head_count": None}, "GGUF metadata llama.attention.head_count is missing"),
    ({"feed_forward_length": None}, "GGUF metadata llama.feed_forward_length is missing"),
    ({"attention.head_count": "four"}, "llama.attention.head_count must be of type int, got 'four'"),
    ({"attention.head_count": [4]}, r"llama.attention.head_count must be of type int, got \[4\]"),
    ({"rope.scaling.type": "linear"}, "GGUF metadata llama.rope.scaling.factor is missing"),
])
def test_gguf_metadata_missing_or_of_the_wrong_type_is_named(tmp_path, metadata, problem):
    import gguf

    path = write_tiny_llama_gguf(tmp_path / "m.gguf", q_proj_type=gguf.GGMLQuantizationType.F32, metadata=metadata)
    with pytest.raises(ValueError, match=problem):
        fm.from_pretrained(path)


def test_gguf_tensor_type_that_cannot_be_dequantized_is_named(tmp_path):
    import gguf

    readable = write_tiny_llama_gguf(tmp_path / "q8_0.gguf", q_proj_type=gguf.GGMLQuantizationType.Q8_0)
    assert fm.from_pretrained(readable).config.num_hidden_layers == 1
    unreadable = write_tiny_llama_gguf(tmp_path / "q8_1.gguf", q_proj_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match=r"q8_1\.gguf: tensor type\(s\) Q8_1 cannot be dequantized.*blk\.0\.attn_q\.weight"):
        fm.from_pretrained(unreadable)


@pytest.mark.parametrize("dtype, problem", [
    (torch.int8, "not a floating-point dtype"), ("int64", "not a floating-point dtype"), ("bf16", "not a torch dtype"),
    (3, "must be a torch.dtype or its name"), ("float64x", "not a torch dtype"),
])
def test_dtype_that_is_not_a_float_dtype_is_named(tmp_path, dtype, problem):
    tiny_llama_dir(tmp_path)
    with pytest.raises(ValueError, match=problem):
        fm.from_pretrained(tmp_path, dtype=dtype)
    with pytest.raises(ValueError, match=problem):
        fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=67, dtype=dtype)


def test_dtype_auto_is_the_checkpoints_own(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    assert fm.from_pretrained(tmp_path, dtype="auto").dtype == torch.bfloat16
    assert fm.from_pretrained(tmp_path).dtype == torch.float32  # the default stays float32
    assert fm.from_pretrained(tmp_path, dtype="torch.float16").dtype == torch.float16  # str(torch.float16)
    with pytest.raises(ValueError, match="'auto'.*is for from_pretrained"):
        fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=67, dtype="auto")


def test_device_is_read_as_torch_reads_it(tmp_path):
    tiny_llama_dir(tmp_path)
    with pytest.raises(ValueError, match="device 'gpu' is not a torch device"):
        fm.from_pretrained(tmp_path, device="gpu")
    if torch.cuda.is_available():  # an int is a CUDA index, as torch.device(0) says
        assert fm.from_pretrained(tmp_path, device=0).device == torch.device("cuda", 0)
    else:
        for device in (0, "cuda", "cuda:1"):
            with pytest.raises(ValueError, match="no CUDA GPU is available here"):
                fm.from_pretrained(tmp_path, device=device)
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match="MPS is not available here"):
            fm.from_pretrained(tmp_path, device="mps")


@pytest.mark.parametrize("hf_class", [transformers.LlamaForSequenceClassification, transformers.LlamaModel])
def test_a_decoder_class_we_do_not_load_is_named(tmp_path, hf_class):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    hf_class(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointKeyError, match=f"names the class {hf_class.__name__}, which flash-models does not "
                                                 "load: a llama checkpoint loads as LlamaForCausalLM"):
        fm.from_pretrained(tmp_path)


def test_folder_holding_only_a_gguf_file_points_at_it(tmp_path):
    (tmp_path / "model.Q4_1.gguf").symlink_to(fm.smollm2_gguf())
    with pytest.raises(FileNotFoundError, match=r"no config.json: not an HF model folder; it holds model\.Q4_1\.gguf: "
                                                "give the .gguf file's path instead"):
        fm.from_pretrained(tmp_path)


def test_config_without_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 97, "hidden_size": 32}))
    with pytest.raises(ValueError, match="config.json has no model_type"):
        fm.from_pretrained(tmp_path)


def test_quantized_hf_checkpoint_is_refused_by_name(tmp_path):
    """Its weights (fp8 with scales, GPTQ/AWQ qweight...) would otherwise be a key listing, or cast without scales."""
    tiny_llama_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="describes a quantized checkpoint .*quant_method 'fp8'"):
        fm.from_pretrained(tmp_path)


def test_torch_dtype_is_the_older_name_of_dtype(tmp_path):
    tiny_llama_dir(tmp_path)
    with pytest.warns(FutureWarning, match="torch_dtype is transformers' older name for dtype"):
        assert fm.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="give dtype only"):
        fm.from_pretrained(tmp_path, dtype=torch.float16, torch_dtype=torch.bfloat16)
