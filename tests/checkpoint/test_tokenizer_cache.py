"""The GGUF tokenizer cache: the first load converts the GGUF metadata and saves a tokenizer folder, later
loads read the folder and behave identically; a changed file gets a new entry; an unwritable cache only costs
speed."""

import logging
import os
from pathlib import Path

import gguf
import transformers

import flash_models as fm
from flash_models.checkpoint.tokenizer import CACHE_ENV, gguf_tokenizer_is_cached, load_gguf_tokenizer

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>", " spaces   and\n\ttabs", "🙂 emoji, ünïcode, 中文"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def count_gguf_conversions(monkeypatch) -> list:
    calls = []
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    return calls


def test_second_load_reads_the_cache_and_behaves_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    conversions = count_gguf_conversions(monkeypatch)
    fresh = load_gguf_tokenizer(fm.smollm2_gguf())
    cached = load_gguf_tokenizer(fm.smollm2_gguf())
    assert len(conversions) == 1
    assert list((tmp_path / "gguf-tokenizers").iterdir())  # one entry, no temporary folder left behind
    assert not [p for p in (tmp_path / "gguf-tokenizers").iterdir() if p.name.startswith(".tmp")]
    for text in TEXTS:
        assert cached(text).input_ids == fresh(text).input_ids
        assert cached.decode(cached(text).input_ids) == fresh.decode(fresh(text).input_ids)
    assert cached.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id, len(cached)) == \
        (fresh.bos_token_id, fresh.eos_token_id, fresh.pad_token_id, len(fresh))
    assert cached.all_special_ids == fresh.all_special_ids


class ConvertedTokenizer:
    """What transformers' GGUF conversion returns, as far as the cache needs: something that saves a folder."""

    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer_config.json").write_text("{}")


def test_a_changed_file_gets_a_new_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    conversions = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *args, **kwargs: conversions.append(kwargs["gguf_file"]) or ConvertedTokenizer())
    model_file = tmp_path / "m.gguf"  # metadata only: a vocabulary, which is checked before the conversion
    writer = gguf.GGUFWriter(str(model_file), "llama")
    writer.add_tokenizer_model("gpt2"), writer.add_token_list(["a", "b", "ab"]), writer.add_token_merges(["a b"])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    assert not gguf_tokenizer_is_cached(model_file)
    load_gguf_tokenizer(model_file)
    assert gguf_tokenizer_is_cached(model_file) and conversions == ["m.gguf"]
    os.utime(model_file, ns=(1, 10**18))  # same path and size, another modification time
    assert not gguf_tokenizer_is_cached(model_file)
    load_gguf_tokenizer(model_file)
    assert conversions == ["m.gguf", "m.gguf"] and len(list((tmp_path / "cache" / "gguf-tokenizers").iterdir())) == 2


def test_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    with caplog.at_level(logging.WARNING):
        tok = load_gguf_tokenizer(fm.smollm2_gguf())
    assert tok("Hello").input_ids
    assert "could not cache the GGUF tokenizer" in caplog.text and CACHE_ENV in caplog.text


def test_cache_can_be_bypassed(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    load_gguf_tokenizer(fm.smollm2_gguf(), use_cache=False)
    assert not (tmp_path / "gguf-tokenizers").exists()
