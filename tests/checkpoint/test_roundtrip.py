"""Checkpoint remapping and files: bit-identical round trips, HF reads what we save, keys on meta models."""

import json

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.checkpoint.loader import build_model
from flash_models.checkpoint.remap import hf_to_ours, ours_to_hf
from flash_models.registry import get_family, get_preset, rules_for
from flash_models.testing import hf_tied_keys, max_rel_err, random_hf_model

TINY = {
    "gpt2": transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "gpt2-untied": transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False),
    "llama": transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
    "llama-tied-bias": transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                                attention_bias=True, mlp_bias=True, max_position_embeddings=32),
}


@pytest.mark.parametrize("name", TINY)
def test_to_hf_of_from_hf_is_bit_identical(name):
    hf = random_hf_model(TINY[name], seed=0)
    hf_state = {k: v for k, v in hf.state_dict().items() if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    rules = rules_for(build_model(hf.config, device="meta").config)
    back = ours_to_hf(hf_to_ours(hf_state, rules), rules)
    assert back.keys() == hf_state.keys()
    for key, tensor in hf_state.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", TINY)
def test_save_pretrained_is_read_by_transformers_with_same_logits(name, tmp_path):
    hf = random_hf_model(TINY[name], seed=1)
    hf.save_pretrained(tmp_path / "hf")
    ours = fm.from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        expected = hf(ids).logits
        assert max_rel_err(reread(ids).logits, expected) < 1e-6
        assert max_rel_err(ours(ids).logits, expected) < 1e-5
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == hf.config.model_type
    assert saved["architectures"] == [type(hf).__name__]


def test_sharded_save_loads_back(tmp_path):
    model = fm.create_model("llama-1b", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=301)
    model.save_pretrained(tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    again = fm.from_pretrained(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 301, (1, 9))
    with torch.no_grad():
        assert max_rel_err(model.eval()(ids).logits, hf(ids).logits) < 1e-5


def test_bin_checkpoint_loads(tmp_path):
    hf = random_hf_model(TINY["gpt2"], seed=2)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = fm.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits, hf(ids).logits) < 1e-5


def test_original_gpt2_keys_without_prefix_load(tmp_path):
    """The original gpt2 files were saved from GPT2Model: no 'transformer.' prefix, plus attn.bias buffers."""
    hf = random_hf_model(TINY["gpt2"], seed=3)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    hf.config.save_pretrained(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        assert max_rel_err(fm.from_pretrained(tmp_path)(ids).logits, hf(ids).logits) < 1e-5


@pytest.mark.parametrize("preset", fm.list_models())
def test_keys_and_shapes_match_hf_on_meta(preset):
    spec = get_preset(preset)
    hf_config = transformers.AutoConfig.for_model(spec.model_type, **spec.hf_config)
    with torch.device("meta"):
        hf = getattr(transformers, get_family(spec.model_type).hf_auto_class).from_config(hf_config)
    ours = build_model(hf_config, device="meta")
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()
                 if k not in hf_tied_keys(hf)}
    ours_shapes = {k: tuple(v.shape) for k, v in ours_to_hf(ours.state_dict(), rules_for(ours.config)).items()}
    assert ours_shapes == hf_shapes


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=97, n_positions=32)
    model.save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    import flash_models.checkpoint.files as files

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", broken_save)
    with torch.no_grad():
        model.embed.tokens.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


TIED_HEADS = {  # a tied config, its HF class, and HF's (head, embeddings) keys
    "gpt2": (TINY["gpt2"], transformers.GPT2LMHeadModel, "lm_head.weight", "transformer.wte.weight"),
    "llama": (TINY["llama-tied-bias"], transformers.LlamaForCausalLM, "lm_head.weight", "model.embed_tokens.weight"),
    "bert-mlm": (transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=48, architectures=["BertForMaskedLM"]),
                 transformers.BertForMaskedLM, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
}


@pytest.mark.parametrize("name", TIED_HEADS)
@pytest.mark.parametrize("head", ["equal", "different", "alone"])
def test_tied_config_with_a_head_of_its_own_loads_as_transformers_does(tmp_path, name, head):
    """transformers ties the head only when the checkpoint's own head equals the embeddings; one that differs is
    used untied (its warning says so), and a head saved without the embeddings is both: the logits must be the
    checkpoint's either way. Old buffers the rules skip (BERT's position_ids) sit beside it."""
    from safetensors.torch import load_file, save_file

    config, hf_class, head_key, embedding_key = TIED_HEADS[name]
    torch.manual_seed(1)
    hf_class(config).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state[head_key] = state[embedding_key].clone() if head == "equal" else torch.randn_like(state[embedding_key])
    if head == "alone":
        state[head_key] = state.pop(embedding_key)
    if name == "bert-mlm":
        state["bert.embeddings.position_ids"] = torch.arange(config.max_position_embeddings)[None]
        # untied, the decoder's bias (which the checkpoint lacks) stays tied to this one in transformers
        state["cls.predictions.bias"] = torch.randn_like(state["cls.predictions.bias"])
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = hf_class.from_pretrained(tmp_path).eval()
    ours = fm.from_pretrained(tmp_path)
    assert ours.config.tie_word_embeddings == (head != "different")
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits, hf(ids).logits) < 1e-5
    ours.save_pretrained(tmp_path / "again")
    again = hf_class.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert max_rel_err(again(ids).logits, hf(ids).logits) < 1e-5
