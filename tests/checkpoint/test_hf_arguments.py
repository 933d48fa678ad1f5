"""transformers' from_pretrained keyword arguments: honoured with HF's meaning, or refused by name."""

import json
import logging
import shutil

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import max_rel_err, random_hf_model

CONFIG = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  tie_word_embeddings=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = random_hf_model(CONFIG, seed=4)
    hf.save_pretrained(folder)
    return hf, folder


def _logits_err(model, hf):
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        return max_rel_err(model(ids).logits.float(), hf(ids).logits)


@pytest.mark.parametrize("kwargs", [
    {"device_map": "cpu"}, {"device_map": "auto"}, {"device_map": {"": "cpu"}}, {"device_map": torch.device("cpu")},
    {"device": "cpu", "device_map": "cpu"}, {"low_cpu_mem_usage": True}, {"trust_remote_code": False},
    {"local_files_only": True}, {"use_safetensors": True}, {"attn_implementation": "eager"},
    {"attn_implementation": "sdpa", "attn_impl": "sdpa"}, {"return_dict": True}, {"revision": "main"},
])
def test_hf_loading_arguments_load_the_same_model(saved, kwargs):
    hf, folder = saved
    model = fm.from_pretrained(folder, **kwargs)
    assert model.device.type == "cpu"
    assert _logits_err(model, hf) < 1e-5


def test_attn_implementation_takes_hf_names(saved):
    _, folder = saved
    assert fm.from_pretrained(folder, attn_implementation="eager").attn_impl == "eager"
    assert fm.from_pretrained(folder, attn_implementation="sdpa").attn_impl == "sdpa"
    with pytest.raises(ValueError, match="attn_impl='sdpa' and attn_implementation='eager' disagree"):
        fm.from_pretrained(folder, attn_impl="sdpa", attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not one flash-models runs"):
        fm.from_pretrained(folder, attn_implementation="flex_attention")


def test_trust_remote_code_never_runs_code_and_says_so(saved, caplog):
    hf, folder = saved
    with caplog.at_level(logging.WARNING, logger="flash_models"):
        model = fm.from_pretrained(folder, trust_remote_code=True)
    assert "trust_remote_code=True has no effect" in caplog.text
    assert _logits_err(model, hf) < 1e-5


@pytest.mark.parametrize("device_map, problem", [
    ({"model": "cpu", "lm_head": "cuda:0"}, "spreads the model over"),
    ("balanced", "spreads the model over several devices"),
])
def test_device_maps_over_several_devices_are_refused(saved, device_map, problem):
    with pytest.raises(ValueError, match=problem):
        fm.from_pretrained(saved[1], device_map=device_map)


def test_device_and_device_map_that_disagree_are_refused(saved):
    with pytest.raises(ValueError, match="name different devices"):
        fm.from_pretrained(saved[1], device="cpu", device_map="meta")


@pytest.mark.parametrize("kwargs, error, problem", [
    ({"bogus": 1}, TypeError, r"unexpected keyword argument\(s\) bogus: neither a loading option nor a field of LlamaConfig"),
    ({"device_mapp": "cpu"}, TypeError, r"device_mapp \(did you mean 'device_map'\?\)"),
    ({"variant": "fp16"}, ValueError, r"does not support variant="),
    ({"load_in_4bit": True}, ValueError, r"does not support load_in_4bit="),
    ({"ignore_mismatched_sizes": True}, ValueError, r"does not support ignore_mismatched_sizes="),
    ({"output_hidden_states": True}, ValueError, r"output_hidden_states=True is not supported"),
    ({"return_dict": False}, ValueError, r"return_dict=False is not supported"),
    ({"use_safetensors": "yes"}, ValueError, r"use_safetensors must be True, False or None"),
])
def test_unknown_or_unsupported_keywords_are_named(saved, kwargs, error, problem):
    with pytest.raises(error, match=problem):
        fm.from_pretrained(saved[1], **kwargs)


def test_config_fields_as_keywords_override_the_checkpoints_as_in_transformers(saved):
    hf, folder = saved
    ours = fm.from_pretrained(folder, rms_norm_eps=0.25)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, rms_norm_eps=0.25).eval()
    assert ours.config.rms_norm_eps == 0.25
    assert _logits_err(ours, theirs) < 1e-5
    assert _logits_err(ours, hf) > 1e-3  # the override took effect
    with pytest.raises(ValueError, match=r"(?s)embed_tokens.*the keyword overrides \['vocab_size'\] changed the checkpoint's config$"):
        fm.from_pretrained(folder, vocab_size=70)


def test_config_object_or_folder_replaces_config_json(saved, tmp_path):
    hf, folder = saved
    changed = transformers.LlamaConfig.from_pretrained(folder)
    changed.rms_norm_eps = 0.25
    ours = fm.from_pretrained(folder, config=changed)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, config=changed).eval()
    assert _logits_err(ours, theirs) < 1e-5 and ours.config.rms_norm_eps == 0.25
    shutil.copytree(folder, tmp_path / "weights")
    (tmp_path / "weights" / "config.json").unlink()  # config= needs no config.json beside the weights
    assert _logits_err(fm.from_pretrained(tmp_path / "weights", config=folder), hf) < 1e-5
    assert _logits_err(fm.from_pretrained(tmp_path / "weights", config=fm.from_pretrained(folder).config), hf) < 1e-5
    with pytest.raises(ValueError, match="config must be a transformers config"):
        fm.from_pretrained(folder, config={"model_type": "llama"})


def test_subfolder_local_and_through_the_hub_cache(saved, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hf, folder = saved
    shutil.copytree(folder, tmp_path / "repo" / "inner")
    assert _logits_err(fm.from_pretrained(tmp_path / "repo", subfolder="inner"), hf) < 1e-5
    with pytest.raises(FileNotFoundError, match=r"no such folder \(subfolder='nope'"):
        fm.from_pretrained(tmp_path / "repo", subfolder="nope")
    with pytest.raises(ValueError, match="must be a relative folder inside"):
        fm.from_pretrained(tmp_path / "repo" / "inner", subfolder="../inner")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "my-cache"  # huggingface_hub's layout: refs/main -> snapshots/<commit>/files
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tmp_path / "repo", cache / "models--someone--nested" / "snapshots" / commit)
    (cache / "models--someone--nested" / "refs").mkdir()
    (cache / "models--someone--nested" / "refs" / "main").write_text(commit)
    # cache_dir= is where huggingface_hub looks, as in transformers
    model = fm.from_pretrained("someone/nested", subfolder="inner", cache_dir=cache, local_files_only=True)
    assert _logits_err(model, hf) < 1e-5


def test_use_safetensors_picks_the_format(saved, tmp_path):
    hf, folder = saved
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert _logits_err(fm.from_pretrained(tmp_path, use_safetensors=False), hf) < 1e-5
    with pytest.raises(FileNotFoundError, match=r"expected one of model\.safetensors.*\(use_safetensors=True\)"):
        fm.from_pretrained(tmp_path, use_safetensors=True)


def test_num_labels_that_does_not_fit_the_head_points_at_a_fresh_head(tmp_path):
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, num_labels=2)
    random_hf_model(config, auto_class="AutoModelForSequenceClassification").save_pretrained(tmp_path)
    model = fm.from_pretrained(tmp_path, num_labels=2, id2label={0: "no", 1: "yes"})
    assert model.config.id2label == {0: "no", 1: "yes"}
    with pytest.raises(ValueError, match=r"(?s)classifier\.weight.*overrides \['num_labels'\].*num_labels=N"):
        fm.from_pretrained(tmp_path, num_labels=5)


def test_dtype_auto_takes_the_config_dtype_first_as_transformers_does(saved, tmp_path):
    hf, folder = saved
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    fields = json.loads((tmp_path / "config.json").read_text())
    for key, name, expected in [("dtype", "bfloat16", torch.bfloat16), ("torch_dtype", "float16", torch.float16),
                                (None, None, torch.float32)]:  # float32 weights on disk
        fields.pop("dtype", None), fields.pop("torch_dtype", None)
        if key is not None:
            fields[key] = name
        (tmp_path / "config.json").write_text(json.dumps(fields))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").dtype
        assert fm.from_pretrained(tmp_path, dtype="auto").dtype == theirs == expected


def test_fresh_head_takes_the_label_names_given_with_num_labels(tmp_path):
    from flash_models.models.bert import BertForSequenceClassification

    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37)
    random_hf_model(config, auto_class="AutoModel").save_pretrained(tmp_path)
    names = {0: "neg", 1: "pos", 2: "neu"}
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3, id2label=names)
    for kwargs in ({"num_labels": 3, "id2label": names}, {"id2label": names}):
        ours = BertForSequenceClassification.from_pretrained(tmp_path, **kwargs)
        assert ours.config.id2label == theirs.config.id2label == names
        assert ours.classifier.weight.shape == theirs.classifier.weight.shape
    assert BertForSequenceClassification.from_pretrained(tmp_path, num_labels=4).config.id2label[3] == "LABEL_3"


@pytest.mark.parametrize("kind, kwargs", [("llama", {"num_hidden_layers": 1}), ("gpt2", {"n_layer": 1}),
                                          ("gpt2", {"num_hidden_layers": 2})])
def test_fewer_layers_as_a_keyword_load_the_first_layers_as_in_transformers(tmp_path, caplog, kind, kwargs):
    """transformers loads the first layers of a deeper checkpoint and leaves the others out, with a warning."""
    config = CONFIG if kind == "llama" else transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=3, n_head=4,
                                                                    n_positions=32)
    hf = random_hf_model(config, seed=6)
    hf.save_pretrained(tmp_path)
    layers = next(iter(kwargs.values()))
    with caplog.at_level(logging.WARNING, logger="flash_models.checkpoint.loader"):
        ours = fm.from_pretrained(tmp_path, **kwargs)
    first_left_out = {"llama": f"model.layers.{layers}.", "gpt2": f"transformer.h.{layers}."}[kind]
    assert "without a place; they are not loaded" in caplog.text and first_left_out in caplog.text
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    assert ref.config.num_hidden_layers == layers == len(ours.blocks)
    assert _logits_err(ours, ref) < 1e-5
    # More layers than the checkpoint holds are not invented: the missing weights are named.
    with pytest.raises(ValueError, match=rf"missing keys .*(layers|h)\.{config.num_hidden_layers}\."):
        fm.from_pretrained(tmp_path, num_hidden_layers=config.num_hidden_layers + 1)
