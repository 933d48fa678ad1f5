"""Crafted or broken checkpoint folders, and user typos: nothing runs code, every error names the file, key or
value at fault, and none repeats a library's internals (or torch's hint to load unsafely)."""

import json
import pickle
import re
import struct

import pytest
import torch
import transformers
from safetensors.torch import save_file

import flash_models as fm
from flash_models.checkpoint import UnsafeCheckpointError
from flash_models.testing import random_hf_model


class FileCreatingPayload:
    """Unpickling this calls open(path, "w"): a stand-in for any code a crafted pickle would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def tiny_llama_dir(path, **overrides):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   **overrides)
    hf = random_hf_model(cfg)
    hf.save_pretrained(path)
    return hf


def test_payload_is_live(tmp_path):
    """The payload the tests below refuse really runs when unpickled the unsafe way."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(FileCreatingPayload(marker)))
    assert marker.exists()


def test_bin_with_code_is_refused_as_unsafe_and_never_run(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.norm.weight"] = FileCreatingPayload(marker)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError) as err:
        fm.from_pretrained(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "pytorch_model.bin") in message and "arbitrary code" in message
    assert re.search(r"it calls [\w.]*open\b", message)  # what it would have called
    assert "weights_only" not in message and "truncated" not in message
    assert not marker.exists()


def test_plain_bin_still_loads(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "pytorch_model.bin")
    ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(fm.from_pretrained(tmp_path)(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zip_format", [True, False])
def test_truncated_bin_says_so_with_a_reason(tmp_path, zip_format):
    hf = tiny_llama_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    path = tmp_path / "pytorch_model.bin"
    torch.save(hf.state_dict(), path, _use_new_zipfile_serialization=zip_format)
    assert fm.from_pretrained(tmp_path).config.num_hidden_layers == 1  # the legacy (non-zip) format loads too
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"pytorch_model.bin: the PyTorch checkpoint is truncated or corrupt \(\S"):
        fm.from_pretrained(tmp_path)


def test_mis_sized_q_proj_names_the_key_and_both_shapes(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.0.self_attn.q_proj.weight"] = torch.randn(24, 32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: expected \(32, 32\), got \(24, 32\)"):
        fm.from_pretrained(tmp_path)


def test_fused_parts_that_do_not_fit_name_their_keys():
    """Below the loader's shape check: the remap transforms themselves name the checkpoint keys."""
    from flash_models.checkpoint.remap import hf_to_ours
    from flash_models.registry import rules_for

    model = fm.create_model("llama-1b", num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    ruleset = rules_for(model.config)
    state = {k: v.contiguous() for k, v in fm.checkpoint.loader.ours_to_hf(model.state_dict(), ruleset).items()}
    state["model.layers.0.self_attn.k_proj.weight"] = torch.randn(16, 31)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight \(16, 31\)"):
        hf_to_ours(state, ruleset)


@pytest.mark.parametrize("text, problem", [
    ('{"model_type": "gpt2", "n_embd": 32,', "is not valid JSON"),
    ('[{"model_type": "gpt2"}]', "must hold a JSON object of config fields, got a list"),
    ('"gpt2"', "must hold a JSON object of config fields, got a str"),
])
def test_bad_config_json_names_the_file(tmp_path, text, problem):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=problem) as err:
        fm.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("field, value", [("rms_norm_eps", "NaN"), ("rms_norm_eps", "1e999"), ("initializer_range", "-Infinity")])
def test_non_finite_config_json_values_are_refused(tmp_path, field, value):
    tiny_llama_dir(tmp_path)
    text = (tmp_path / "config.json").read_text()
    config = json.loads(text)
    config[field] = 0.5  # a unique placeholder, replaced by the raw JSON token
    (tmp_path / "config.json").write_text(json.dumps(config).replace(f'"{field}": 0.5', f'"{field}": {value}'))
    with pytest.raises(ValueError, match=rf"config\.json: config value {field}=-?(nan|inf) is not a finite number"):
        fm.from_pretrained(tmp_path)


def test_non_finite_rope_theta_in_config_json(tmp_path):
    tiny_llama_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(config).replace('"rope_theta": 0.5', '"rope_theta": Infinity'))
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_theta=inf is not a finite number"):
        fm.from_pretrained(tmp_path)


@pytest.mark.parametrize("overrides, problem", [
    (dict(n_embd=32, n_head=5), r"hidden size \(32\) must be a multiple of the number of attention heads \(5\)"),
    (dict(layer_norm_epsilon=float("nan")), r"layer_norm_epsilon=nan is not a finite number"),
    (dict(vocab_size=0), r"vocab_size must be > 0, got 0"),
    (dict(n_head=0), r"num_attention_heads must be > 0, got 0"),
    (dict(attn_pdrop=1.5), r"attention_dropout must lie in \[0, 1\], got 1.5"),
])
def test_create_model_validates_gpt2_as_hf_does(overrides, problem):
    with pytest.raises(ValueError, match=problem):
        fm.create_model("gpt2", **{"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 97, **overrides})


def test_create_model_refuses_non_finite_rope_and_bad_gqa():
    small = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=4, vocab_size=97)
    with pytest.raises(ValueError, match=r"rope_theta=inf is not a finite number"):
        fm.create_model("llama-1b", **small, num_key_value_heads=2,
                        rope_parameters={"rope_type": "default", "rope_theta": float("inf")})
    with pytest.raises(ValueError, match=r"rms_norm_eps=nan"):
        fm.create_model("llama-1b", **small, num_key_value_heads=2, rms_norm_eps=float("nan"))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        fm.create_model("llama-1b", **small, num_key_value_heads=3)


def test_create_model_turns_transformers_validation_into_a_named_error():
    with pytest.raises(ValueError, match=r"create_model\('gpt2'\): invalid config: .*n_embd"):
        fm.create_model("gpt2", n_layer=1, n_embd="wide", n_head=4)


def _crafted_safetensors_header(folder, field, rewrite):
    """Rewrite ``field`` of the first tensor's entry in folder's model.safetensors header with ``rewrite(old)``."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name][field] = rewrite(header[name][field])
    new_header = json.dumps(header).encode()
    new_header += b" " * (-len(new_header) % 8)
    path.write_bytes(struct.pack("<Q", len(new_header)) + new_header + raw[8 + n:])


@pytest.mark.parametrize("field, rewrite", [
    ("data_offsets", lambda offsets: [offsets[0], offsets[1] + 10**9]),  # points far past the end of the file
    ("shape", lambda shape: [2**40, 2**40]),  # 2**80 elements: refused before any allocation
], ids=["offsets", "shape"])
def test_safetensors_header_that_lies(tmp_path, field, rewrite):
    tiny_llama_dir(tmp_path)
    _crafted_safetensors_header(tmp_path, field, rewrite)
    with pytest.raises(ValueError, match=r"model\.safetensors: the safetensors file is truncated or corrupt"):
        fm.from_pretrained(tmp_path)


def test_safetensors_header_length_beyond_the_file(tmp_path):
    tiny_llama_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fm.from_pretrained(tmp_path)


def test_gguf_with_a_truncated_tensor_names_it(tmp_path):
    data = fm.smollm2_gguf().read_bytes()
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(data[: len(data) - 4096])  # header intact, the last tensor's data cut short
    with pytest.raises(ValueError, match=r"cut\.gguf.*tensor '.*' runs past the end of the file"):
        fm.from_pretrained(broken)


def test_symlinked_weights_as_in_the_hub_cache_load(tmp_path):
    """The HF cache keeps files as symlinks into a blobs folder: links are followed, not refused."""
    hf = tiny_llama_dir(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).symlink_to(tmp_path / "blobs" / name)
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(fm.from_pretrained(snapshot)(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_dangling_weight_symlink_is_a_clear_error(tmp_path):
    tiny_llama_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights in"):
        fm.from_pretrained(tmp_path)


def test_create_model_refuses_a_misspelled_override():
    """HF's config would keep ``n_embed`` as a stray attribute and build the default width: refused, with a hint."""
    with pytest.raises(ValueError, match=r"create_model\('gpt2'\): n_embed is not a field of GPT2Config; did you mean 'n_embd'\?"):
        fm.create_model("gpt2", n_layer=1, n_embed=32, n_head=4)
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, num_attention_heads=4, vocab_size=97, num_labels=3)
    assert model.config.n_head == 4  # HF's attribute aliases stay accepted


@pytest.mark.parametrize("field, raw, problem", [
    ("num_hidden_layers", str(10**30), r"num_hidden_layers=10{30} does not fit in a 64-bit integer"),
    ("hidden_size", "99999999999999999999", r"hidden_size=99999999999999999999 does not fit in a 64-bit integer"),
    ("vocab_size", "1e400", r"vocab_size=inf is not a finite number"),
    ("intermediate_size", str(2**62), rf"intermediate_size={2**62} is too large: at most 2147483647"),
    ("num_hidden_layers", str(10**8), r"num_hidden_layers=100000000 is too large: at most 10000 \(layers\)"),
    ("bos_token_id", str(-2**70), r"bos_token_id=-\d+ does not fit in a 64-bit integer"),
])
def test_huge_numbers_in_config_json_are_refused_before_anything_is_built(tmp_path, field, raw, problem):
    """JSON integers have no size limit: each is refused with the file and the field named, before any model
    is built (10**8 layers would take a day to build even on the meta device)."""
    tiny_llama_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = 12345  # a unique placeholder, replaced by the raw JSON token
    (tmp_path / "config.json").write_text(json.dumps(config).replace(f'"{field}": 12345', f'"{field}": {raw}'))
    with pytest.raises(ValueError, match=problem) as err:
        fm.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_sizes_implying_absurd_parameter_counts_are_refused(tmp_path):
    """Every size fits in int32, but together they imply more parameters than any checkpoint holds (and a fused
    weight's element count would overflow int64): refused from config.json, and from create_model's overrides
    before a byte is allocated."""
    tiny_llama_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(hidden_size=2**20, num_attention_heads=2**10, num_key_value_heads=2**10, intermediate_size=2**30)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: the config's sizes \(.*hidden_size=1048576.*\) imply about "
                                         r"\S+ parameters, more than the 1e\+13"):
        fm.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"n_layer=50000 is too large"):
        fm.create_model("gpt2", n_layer=50_000)
    with pytest.raises(ValueError, match=r"imply about .* parameters"):
        fm.create_model("gpt2", n_layer=2, n_embd=2**24, n_head=2**10)


def _shard_index(folder, weight_map):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_shard_index_naming_files_outside_the_folder_is_refused(tmp_path):
    """A crafted index must not make the loader read weights from elsewhere: ``../`` and absolute shard names
    are refused (HF writes plain file names); a malformed index is named, not a KeyError."""
    folder, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    tiny_llama_dir(folder)
    elsewhere.mkdir()
    (folder / "model.safetensors").rename(elsewhere / "model.safetensors")
    keys = list(tiny_llama_dir(tmp_path / "keys").state_dict())
    for shard in ("../elsewhere/model.safetensors", str(elsewhere / "model.safetensors")):
        _shard_index(folder, {k: shard for k in keys})
        with pytest.raises(ValueError, match=r"index\.json names shards outside its folder"):
            fm.from_pretrained(folder)
    _shard_index(folder, ["model.safetensors"])
    with pytest.raises(ValueError, match=r"weight_map must map tensor names to shard file names"):
        fm.from_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"index\.json is not a checkpoint index"):
        fm.from_pretrained(folder)


EVIL_MODULE = "open({marker!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n" \
              "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"


def test_config_auto_map_never_imports_code_from_the_folder(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (tmp_path / name).write_text(EVIL_MODULE.format(marker=str(marker)))
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(fm.from_pretrained(tmp_path)(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert not marker.exists()


def test_tokenizer_that_is_code_is_refused_without_a_prompt(tmp_path, monkeypatch):
    """A tokenizer_config.json whose tokenizer is a class in the folder (auto_map): refused with our error, never
    run, and never transformers' interactive "run the custom code? [y/N]" prompt (stdin would answer it)."""
    from flash_models.checkpoint.tokenizer import load_tokenizer

    tiny_llama_dir(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    (tmp_path / "tokenization_evil.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}}))
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # a prompt would be answered yes
    with pytest.raises(ValueError, match=r"the tokenizer is code shipped with the checkpoint .* never runs code"):
        load_tokenizer(tmp_path)
    assert not marker.exists()


def _gguf_bytes(fields, tensors):
    def string(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields))
    for key, (value_type, packed) in fields.items():
        out += string(key) + struct.pack("<I", value_type) + packed
    for name, dims, tensor_type, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", tensor_type, offset)
    return out + bytes(64)


@pytest.mark.parametrize("fields, tensors, problem", [
    ({"general.alignment": (4, struct.pack("<I", 0))}, [("x", (4,), 0, 0)], "general.alignment must be a positive"),
    ({}, [("x", (2**32, 2**32), 0, 0)], "tensor 'x' runs past the end of the file"),  # 2**64 elements: int64 wraps to 0
    ({}, [("x", (2**63 + 5,), 0, 0)], "tensor 'x' runs past the end of the file"),
])
def test_gguf_with_absurd_layout_is_a_named_error(tmp_path, fields, tensors, problem):
    path = tmp_path / "crafted.gguf"
    path.write_bytes(_gguf_bytes(fields, tensors))
    with pytest.raises(ValueError, match=rf"crafted\.gguf: not a valid GGUF file or truncated \({problem}"):
        fm.from_pretrained(path)
