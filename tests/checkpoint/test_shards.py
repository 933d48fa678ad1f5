"""Sharded checkpoints are read as their index says: each tensor from the shard the index names, and an index
that disagrees with its shards (a tensor in two shards, one listed but absent, one not listed) is named."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import flash_models as fm
from flash_models.testing import max_rel_err, random_hf_model

CONFIG = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  tie_word_embeddings=False)


@pytest.fixture
def sharded(tmp_path):
    hf = random_hf_model(CONFIG, seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    return hf, tmp_path, index, shards


def _rewrite(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_with_hf_logits(sharded):
    hf, folder, _, _ = sharded
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert max_rel_err(fm.from_pretrained(folder)(ids).logits, hf(ids).logits) < 1e-5


def test_a_tensor_in_two_shards_is_not_silently_taken_from_the_later_one(sharded):
    _, folder, index, shards = sharded
    key = next(k for k, s in index["weight_map"].items() if s == shards[0])
    _rewrite(folder / shards[1], lambda t: t.update({key: torch.randn(load_file(folder / shards[0])[key].shape)}))
    with pytest.raises(ValueError, match=rf"{shards[1]} disagree: it holds 1 tensor\(s\) the index does not place in it: {key}"):
        fm.from_pretrained(folder)


def test_a_tensor_the_index_lists_but_its_shard_lacks_is_named(sharded):
    _, folder, index, shards = sharded
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = shards[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists 1 tensor\(s\) in it that it does not hold: model\.layers\.0\.mlp\.ghost\.weight"):
        fm.from_pretrained(folder)


def test_an_unlisted_extra_tensor_in_a_shard_is_named(sharded):
    _, folder, _, shards = sharded
    _rewrite(folder / shards[-1], lambda t: t.update({"model.extra.weight": torch.randn(3)}))
    with pytest.raises(ValueError, match=r"does not place in it: model\.extra\.weight.*download it again"):
        fm.from_pretrained(folder)


def test_sharded_bin_checkpoint_follows_its_index_too(sharded, tmp_path_factory):
    hf, _, _, _ = sharded
    folder = tmp_path_factory.mktemp("bin")
    hf.config.save_pretrained(folder)
    state = hf.state_dict()
    keys = sorted(state)
    half = len(keys) // 2
    parts = {"pytorch_model-00001-of-00002.bin": keys[:half], "pytorch_model-00002-of-00002.bin": keys[half:]}
    for name, names in parts.items():
        torch.save({k: state[k].clone() for k in names}, folder / name)
    index = {"metadata": {}, "weight_map": {k: name for name, names in parts.items() for k in names}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    ids = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        assert max_rel_err(fm.from_pretrained(folder)(ids).logits, hf(ids).logits) < 1e-5
    torch.save({k: state[k].clone() for k in keys[: half + 1]}, folder / "pytorch_model-00001-of-00002.bin")
    with pytest.raises(ValueError, match=rf"pytorch_model\.bin\.index\.json and its shard pytorch_model-00001-of-00002\.bin disagree.*{keys[half]}"):
        fm.from_pretrained(folder)
