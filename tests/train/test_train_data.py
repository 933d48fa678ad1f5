import json

import numpy as np
import pytest
import torch

from flash_models.testing import ours_from_hf, random_hf_model
from flash_models.train.config import DataSection
from flash_models.train.data import (
    IGNORE, ByteTokenizer, LMWindows, PackedExamples, StepSampler, build_token_store, collate_lm, load_tokenizer,
)


def store_of(tmp_path, docs, *, write=True, **cfg):
    path = tmp_path / "docs.txt"
    if write:
        path.write_text("\n\n".join(docs))
    section = DataSection(format="text", train=str(path), cache_dir=str(tmp_path / "cache"), **cfg)
    return build_token_store(str(path), ByteTokenizer(), section)


def test_token_cache_is_memmap_reused_and_keyed_by_content(tmp_path):
    store = store_of(tmp_path, ["ab", "cde", "f"])
    assert isinstance(store.tokens, np.memmap)
    assert store.tokens.tolist() == [97, 98, 256, 99, 100, 101, 256, 102, 256]
    assert store.doc_offsets.tolist() == [0, 3, 7, 9]
    again = store_of(tmp_path, None, write=False)
    assert again.path == store.path
    changed = store_of(tmp_path, ["ab", "cdX", "f"])
    assert changed.path != store.path and changed.tokens[5] == ord("X")


def test_document_windows_carry_boundaries_and_ignore_each_document_start(tmp_path):
    store = store_of(tmp_path, ["abcd", "efghijk", "lm", "nopqrstuvw"])  # lengths 5, 8, 3, 11 with EOS
    ds = LMWindows(store, 8, packing="documents")
    assert len(ds) == 27 // 8
    item = ds[0]  # tokens 0..7: doc0 (5) + 3 tokens of doc1
    assert item["seqlens"] == [5, 3]
    assert item["labels"][0] == IGNORE and item["labels"][5] == IGNORE
    assert (item["labels"][[1, 2, 3, 4, 6, 7]] == item["input_ids"][[1, 2, 3, 4, 6, 7]]).all()
    assert ds[1]["seqlens"] == [5, 3]  # rest of doc1 (5), doc2 (3)
    batch = collate_lm([ds[0], ds[1]])
    assert batch["input_ids"].shape == (1, 16)
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 13, 16] and batch["cu_seqlens"].dtype == torch.int32
    stream = LMWindows(store, 8, packing="stream")[0]
    assert stream["seqlens"] is None and (stream["labels"] == stream["input_ids"]).all()


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_documents_never_attend_across(family, attn_impl):
    """d(output of a token) / d(input embedding of another document's tokens) is exactly zero."""
    import transformers

    if family == "gpt2":
        hf_cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = ours_from_hf(random_hf_model(hf_cfg, seed=3), attn_impl=attn_impl)
    cu = torch.tensor([0, 7, 8, 19, 30], dtype=torch.int32)
    ids = torch.randint(0, 97, (1, 30))
    captured = {}

    def keep(module, args, out):
        out.retain_grad()
        captured["embeds"] = out

    handle = model.embed.register_forward_hook(keep)
    logits = model(ids, cu_seqlens=cu).logits
    handle.remove()
    doc = torch.searchsorted(cu[1:], torch.arange(30), right=True)
    for t in (6, 7, 12, 29):  # last token of doc 0, the one-token doc 1, inside doc 2, end of doc 3
        captured["embeds"].grad = None
        logits[0, t].square().sum().backward(retain_graph=True)
        g = captured["embeds"].grad[0].abs().sum(-1)  # (30,)
        other = doc != doc[t]
        assert (g[other] == 0).all(), f"token {t} got gradient from documents {doc[other & (g > 0)].unique().tolist()}"
        own_past = (doc == doc[t]) & (torch.arange(30) <= t)
        assert (g[own_past] > 0).all()
    # and each document alone gives the same logits as inside the pack
    with torch.no_grad():
        alone = model(ids[:, 8:19]).logits
    assert torch.allclose(alone, logits[:, 8:19].detach(), atol=1e-5)


def test_sft_byte_tokenizer_masks_prompt(tmp_path):
    rows = [{"prompt": "2+2?", "response": "4"}, {"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataSection(format="sft", train=str(path), cache_dir=str(tmp_path / "cache"), seq_len=64)
    store = build_token_store(str(path), ByteTokenizer(), cfg, sft=True)
    ds = PackedExamples(store, 64, pad_id=256)
    assert len(ds) == 1
    item = ds[0]
    tok = ByteTokenizer()
    trained = [int(i) for i, l in zip(item["input_ids"], item["labels"]) if l != IGNORE]
    assert tok.decode(trained) == "4hello" and trained.count(256) == 2  # the answers and their EOS only
    assert item["seqlens"][:2] == [len("user: 2+2?\nassistant: ") + 2, len("user: hi\nassistant: ") + 6]


def test_sft_examples_whose_prompt_fills_the_window_are_named(tmp_path, caplog):
    """Truncated to their prompts, they trained on nothing: every step's loss read 0.0."""
    rows = [{"prompt": "a long question " * 4, "response": "yes"}, {"prompt": "hi", "response": "hello"}]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataSection(format="sft", train=str(path), cache_dir=str(tmp_path / "cache"), seq_len=24)
    store = build_token_store(str(path), ByteTokenizer(), cfg, sft=True)
    with caplog.at_level("WARNING", logger="flash_models.train.data"):
        assert len(PackedExamples(store, 24, pad_id=256)) == 2
    assert "1 of 2 examples have no answer token within data.seq_len=24" in caplog.text
    path.write_text(json.dumps(rows[0]))
    store = build_token_store(str(path), ByteTokenizer(), cfg, sft=True)
    with pytest.raises(ValueError, match="no example has an answer token within data.seq_len=24.*raise data.seq_len"):
        PackedExamples(store, 24, pad_id=256)


def test_a_null_text_is_refused_not_trained_as_none(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a document"}\n{"text": null}\n')
    cfg = DataSection(format="jsonl", train=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="field 'text' is null"):
        build_token_store(str(path), ByteTokenizer(), cfg)


@pytest.mark.slow
def test_sft_chat_template_masks_everything_but_assistant_turns(tmp_path):
    """The real SmolLM2 chat template: multi-turn, loss only on the assistant turns' tokens."""
    tok = load_tokenizer("smollm2")
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": messages}))
    cfg = DataSection(format="sft", train=str(path), cache_dir=str(tmp_path / "cache"), seq_len=256)
    item = PackedExamples(build_token_store(str(path), tok, cfg, sft=True), 256, pad_id=tok.pad_token_id)[0]
    trained = item["input_ids"][item["labels"] != IGNORE]
    text = tok.decode(trained)
    assert "Blue." in text and "Green." in text
    assert "Name a colour" not in text and "Another" not in text and "user" not in text
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert item["input_ids"][:len(full)].tolist() == list(full)


def test_step_sampler_is_seeded_resumable_and_sharded():
    a = StepSampler(10, global_batch=4, seed=1)
    steps = [a.next_step() for _ in range(5)]  # crosses two epoch boundaries
    assert sorted(steps[0] + steps[1] + steps[2][:2]) == list(range(10))
    b = StepSampler(10, global_batch=4, seed=1)
    b.next_step(), b.next_step()
    state = b.state_dict()
    c = StepSampler(10, global_batch=4, seed=1)
    c.load_state_dict(state)
    assert [c.next_step() for _ in range(3)] == steps[2:]
    r0 = StepSampler(10, global_batch=4, seed=1, rank=0, world=2).next_step()
    r1 = StepSampler(10, global_batch=4, seed=1, rank=1, world=2).next_step()
    assert sorted(r0 + r1) == sorted(steps[0])


def test_hf_dataset_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")  # in the test extra; importorskip only for a bare install
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["abc", "de"]}),
                               "validation": datasets.Dataset.from_dict({"body": ["x"]})})
    ds.save_to_disk(str(tmp_path / "hf"))
    cfg = DataSection(format="hf_disk", train=f"{tmp_path / 'hf'}:train", text_field="body", cache_dir=str(tmp_path / "c"))
    store = build_token_store(cfg.train, ByteTokenizer(), cfg)
    assert store.tokens.tolist() == [97, 98, 99, 256, 100, 101, 256]


def test_sft_from_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")  # in the test extra; importorskip only for a bare install
    rows = {"prompt": ["1+1?", "2+2?"], "response": ["2", "4"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "sft"))
    cfg = DataSection(format="sft", train=f"{tmp_path / 'sft'}:train", cache_dir=str(tmp_path / "c"), seq_len=64)
    store = build_token_store(cfg.train, ByteTokenizer(), cfg, sft=True)
    item = PackedExamples(store, 64, pad_id=256)[0]
    trained = [int(i) for i, l in zip(item["input_ids"], item["labels"]) if l != IGNORE]
    assert ByteTokenizer().decode(trained) == "24" and store.num_docs == 2


def test_classification_and_sft_from_a_split_of_a_saved_hf_dataset(tmp_path):
    """Text classification read a saved dataset's arrow files as JSONL (UnicodeDecodeError), and the path check
    refused PATH:SPLIT for every format but hf_disk."""
    datasets = pytest.importorskip("datasets")  # in the test extra; importorskip only for a bare install
    from flash_models.train import load_config
    from flash_models.train.classification import TextClassification
    from flash_models.train.preflight import check_paths

    rows = {"text": ["good", "bad", "fine"], "label": ["pos", "neg", "pos"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "validation": datasets.Dataset.from_dict({"text": ["meh"], "label": ["neg"]})}
                         ).save_to_disk(str(tmp_path / "cls"))
    cfg = load_config({"model": {"task": "sequence_classification"},
                       "data": {"format": "classification", "train": f"{tmp_path / 'cls'}:train",
                                "eval": f"{tmp_path / 'cls'}:validation", "tokenizer": "bytes"}})
    check_paths(cfg)
    train = TextClassification(cfg.data.train, ByteTokenizer(), cfg.data)
    assert train.label_names == ["neg", "pos"] and train.labels == [1, 0, 1] and train[1]["input_ids"] == [98, 97, 100]
    assert TextClassification(cfg.data.eval, ByteTokenizer(), cfg.data, label_names=train.label_names).labels == [0]
    check_paths(load_config({"data": {"format": "sft", "train": f"{tmp_path / 'cls'}:train", "tokenizer": "bytes"}}))
    with pytest.raises(FileNotFoundError, match="data.train: no data at"):
        check_paths(load_config({"data": {"format": "sft", "train": f"{tmp_path / 'nope'}:train"}}))


def test_files_saved_with_a_byte_order_mark_read_as_without(tmp_path):
    """Windows tools write a UTF-8 BOM: it broke the first JSONL line, renamed the first CSV column and was trained
    on as three bytes of text."""
    from flash_models.train.data import iter_records

    (tmp_path / "rows.jsonl").write_bytes('\ufeff{"text": "a"}\n{"text": "b"}\n'.encode())
    (tmp_path / "rows.csv").write_bytes("\ufefftext,label\nhello,1\n".encode())
    (tmp_path / "doc.txt").write_bytes("\ufeffone\n\ntwo".encode())
    assert list(iter_records("jsonl", str(tmp_path / "rows.jsonl"))) == [{"text": "a"}, {"text": "b"}]
    assert list(iter_records("classification", str(tmp_path / "rows.csv"))) == [{"text": "hello", "label": "1"}]
    assert list(iter_records("text", str(tmp_path / "doc.txt"))) == [{"text": "one"}, {"text": "two"}]
