"""GGUF files that cannot be used as they are: each is named in one line by the command line (before the
tokenizer, which transformers reads from the same file, or the weights load) and by ``fm.from_pretrained``; a
file without a vocabulary still loads and converts (weights alone)."""

import numpy as np
import pytest
import torch
import transformers
from cli_helpers import assert_short_error, run_cli
from test_gguf_types import Q, write_gguf

import flash_models as fm
from flash_models.checkpoint.gguf_file import check_gguf
from flash_models.convert import convert
from flash_models.testing import random_hf_model

gguf = pytest.importorskip("gguf")


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return random_hf_model(config, seed=int(torch.randint(0, 1000, ()).item()))


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(path, tiny_llama(), Q.F32)
    return path


def test_truncated_file_is_named_by_chat_and_convert(llama_gguf, tmp_path):
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])  # inside the tensor data: transformers' tokenizer reader fails on a reshape
    assert_short_error(run_cli("chat", str(cut), "hi"), "not a valid GGUF file or truncated", "runs past the end")
    assert_short_error(run_cli("convert", str(cut), str(tmp_path / "out")), "truncated")
    assert not (tmp_path / "out").exists()
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:100])
    with pytest.raises(ValueError, match=r"truncated \(its header ends early, at byte 100\)"):
        fm.from_pretrained(header)


def test_bpe_vocabulary_without_merges_is_named(llama_gguf, tmp_path):
    """(test_gguf_types' files hold such a vocabulary: enough for the weights, not for a tokenizer)"""
    assert_short_error(run_cli("chat", str(llama_gguf), "hi"), "has no merges", "tokenizer.ggml.merges")
    run = run_cli("convert", str(llama_gguf), str(tmp_path / "out"))  # the weights alone, said so
    assert run.returncode == 0 and "has no merges" in run.stderr and "holds the model only" in run.stderr, run.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "model.safetensors").is_file()


def test_unsupported_architecture_is_named_before_the_tokenizer(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1), w.add_tokenizer_model("gpt2"), w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    assert_short_error(run_cli("chat", str(path), "hi"), "GGUF architecture 'falcon' is not supported",
                       "llama, qwen2, qwen3, phi3, gemma, gemma2, gpt2")


def test_unknown_tensor_is_named_before_any_dequantizing(tmp_path):
    path = tmp_path / "extra.gguf"  # one tensor a llama has no place for, as a variant's file would hold
    write_gguf(path, tiny_llama(), Q.F32, extra_tensors={"blk.0.attn_sinks.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"extra\.gguf: GGUF tensor\(s\) blk\.0\.attn_sinks\.weight have no "
                                         r"counterpart in flash-models' llama model"):
        check_gguf(path)
    assert_short_error(run_cli("convert", str(path), str(tmp_path / "out")), "blk.0.attn_sinks.weight")
    assert not (tmp_path / "out").exists()


def test_file_without_a_vocabulary_loads_converts_and_is_refused_by_chat(tmp_path):
    """llama.cpp's converter can write the weights alone: the vocabulary size comes from the embedding, the
    converted folder holds the model (transformers loads it), and chat names the missing tokenizer."""
    hf = tiny_llama()
    path = tmp_path / "bare.gguf"
    write_gguf(path, hf, Q.F32, vocabulary=False)
    ids = torch.randint(0, 64, (2, 9))
    ours = fm.from_pretrained(path)
    assert ours.config.vocab_size == 64
    with torch.no_grad():
        reference = hf(ids).logits
        assert (ours(ids).logits - reference).abs().max().item() < 1e-4
    assert_short_error(run_cli("chat", str(path), "hi"), "holds no tokenizer", "tokenizer.ggml.model")
    run = run_cli("convert", str(path), str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert "holds no tokenizer" in run.stderr and "holds the model only" in run.stderr
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (converted(ids).logits - reference).abs().max().item() < 1e-4
    assert converted.generation_config.eos_token_id == 2  # the ids the metadata names, without a vocabulary


def test_convert_refuses_to_replace_the_folder_that_holds_its_source(tmp_path):
    """DST is replaced whole: with --overwrite, a GGUF file inside it (or the HF folder itself) would be deleted."""
    folder = tmp_path / "models"
    folder.mkdir()
    source = folder / "m.gguf"
    write_gguf(source, tiny_llama(), Q.F32, vocabulary=False)
    content = source.read_bytes()
    assert_short_error(run_cli("convert", str(source), str(folder), "--overwrite"),
                       f"{folder} holds the source {source}", "write into another folder")
    assert source.read_bytes() == content
    with pytest.raises(ValueError, match="is the source folder"):
        convert(folder, folder)
    run = run_cli("convert", str(source), str(folder / "hf"))  # into a new folder beside it: fine
    assert run.returncode == 0, run.stderr
    assert source.is_file() and (folder / "hf" / "model.safetensors").is_file()


def test_a_gguf_file_under_another_name_loads_as_gguf(tmp_path):
    """A GGUF file saved as ``model.bin`` (or with no suffix) is read by its magic bytes, not looked for as a model
    folder; any other file of that name still gets the folder error."""
    hf = tiny_llama()
    ids = torch.randint(0, 64, (2, 7))
    for name in ("model.bin", "model"):
        path = tmp_path / name
        write_gguf(path, hf, Q.F32)
        with torch.no_grad():
            assert (fm.from_pretrained(path)(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 16)
    with pytest.raises(FileNotFoundError, match="no model folder there"):
        fm.from_pretrained(other)
