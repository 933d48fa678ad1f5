"""LoRA adapters between HF's models and ours: PEFT adapters trained on transformers' models (q_proj, v_proj,
c_attn, ...) load onto our fused projections, merged or as a PeftModel, and adapters trained on ours save in
HF's layout for PeftModel.from_pretrained on transformers' model. Every check compares logits in fp32."""

import copy
import json
import sys

import peft
import pytest
import torch
import transformers

import flash_models as fm
from flash_models.hf.lora import load_hf_adapter, save_hf_adapter
from flash_models.registry import get_family, get_preset
from flash_models.testing import max_rel_err, ours_from_hf, random_hf_model
from tests.models.test_contract import one_preset_per_family
from tests.models.test_family_parity import inputs_for, real_tokens, tiny_hf_config

VOCAB = 97
TOL = 1e-5

# HF config class and fields, and a PEFT LoraConfig on HF's names: a subset of the projections of a fused layer
# (k_proj left out), ranks and alphas per module, rsLoRA, Conv1D (GPT-2), heads interleaved in one qkv linear
# (GPT-NeoX), the untied LM head (its rows padded in our model).
FAMILIES = {
    "llama_gqa": (
        transformers.LlamaConfig, dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False),
        dict(r=4, lora_alpha=8, task_type="CAUSAL_LM",
             target_modules=["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"],
             rank_pattern={"v_proj": 2, "layers.1.mlp.down_proj": 3}, alpha_pattern={"q_proj": 5, "lm_head": 2})),
    "qwen2_bias_rslora": (
        transformers.Qwen2Config, dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64),
        dict(r=3, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
             rank_pattern={"k_proj": 5}, alpha_pattern={"v_proj": 4})),
    "gpt2_conv1d": (
        transformers.GPT2Config, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                      eos_token_id=0),
        dict(r=4, lora_alpha=16, target_modules=["c_attn", "c_fc", "c_proj"], fan_in_fan_out=True,
             rank_pattern={"mlp.c_proj": 2}, layers_to_transform=[1])),
    "neox_interleaved": (
        transformers.GPTNeoXConfig, dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                                         hidden_dropout=0.0, attention_dropout=0.0),
        dict(r=4, lora_alpha=12, target_modules=["query_key_value", "dense_4h_to_h"],
             alpha_pattern={"dense_4h_to_h": 3})),
    # PEFT's SEQ_CLS task saves the classifier whole (modules_to_save); "dense" names four kinds of layer.
    "bert_seq_cls": (
        transformers.BertConfig, dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, max_position_embeddings=64, num_labels=3,
                                      architectures=["BertForSequenceClassification"],
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        dict(r=4, lora_alpha=8, task_type="SEQ_CLS", target_modules=["query", "value", "dense"],
             rank_pattern={"intermediate.dense": 2})),
}
AUTO_CLASS = {"bert_seq_cls": "AutoModelForSequenceClassification"}  # else AutoModelForCausalLM


def hf_model(family: str, seed: int = 0, **config):
    config_class, fields, _ = FAMILIES[family]
    return random_hf_model(config_class(**{**fields, **config}), seed=seed,
                           auto_class=AUTO_CLASS.get(family, "AutoModelForCausalLM"))


def random_lora_(model: torch.nn.Module) -> None:
    """Random nonzero A and B (PEFT's own init leaves B at zero: the adapter would compute nothing), and new
    values in the trained copies of modules_to_save (PEFT starts them as copies of the base model's)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name or ".modules_to_save." in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))


def hf_adapter(family: str, folder, *, seed: int = 0, config: dict | None = None, safe_serialization: bool = True,
               **overrides):
    """A random LoRA adapter on HF's model of ``family`` (its config changed by ``config``), saved by PEFT to
    ``folder``; returns the PeftModel."""
    adapted = peft.get_peft_model(hf_model(family, seed, **(config or {})),
                                  peft.LoraConfig(**{**FAMILIES[family][2], **overrides}))
    random_lora_(adapted)
    adapted.save_pretrained(folder, safe_serialization=safe_serialization)
    return adapted.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_adapter_on_our_model_merged_and_unmerged(family, tmp_path):
    theirs = hf_adapter(family, tmp_path / "adapter")
    ids = torch.randint(0, VOCAB, (2, 11))
    expected = logits(theirs, ids)
    base = logits(ours_from_hf(hf_model(family)), ids)
    assert max_rel_err(base, expected) > 1e-2  # the adapter changes the numbers

    merged = load_hf_adapter(ours_from_hf(hf_model(family)), tmp_path / "adapter", merge=True)
    assert type(merged).__name__ == type(theirs.get_base_model()).__name__  # a plain model of ours
    assert max_rel_err(logits(merged, ids), expected) < TOL

    adapted = load_hf_adapter(ours_from_hf(hf_model(family)), tmp_path / "adapter")
    assert type(adapted) is type(theirs)  # PEFT's wrapper for the adapter's task_type
    assert max_rel_err(logits(adapted, ids), expected) < TOL
    assert not any(p.requires_grad for p in adapted.parameters())  # as PeftModel.from_pretrained: frozen unless asked
    with adapted.disable_adapter():
        assert max_rel_err(logits(adapted, ids), base) < TOL
    assert max_rel_err(logits(adapted.merge_and_unload(), ids), expected) < TOL


def test_fused_layers_get_exact_ranks_and_zero_blocks(tmp_path):
    """q_proj (rank 4) and v_proj (rank 2) of the LLaMA adapter are one LoRA on qkv of rank 6 whose B is zero on
    k's rows; gate_up holds up_proj's LoRA only."""
    hf_adapter("llama_gqa", tmp_path / "adapter")
    adapted = load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "adapter")
    qkv = adapted.base_model.model.blocks[0].attn.qkv
    assert qkv.lora_A["default"].weight.shape == (6, 32)
    B = qkv.lora_B["default"].weight  # rows: q (4 heads x 8), k (2 x 8), v (2 x 8)
    assert B[32:48].abs().max() == 0 and B[:32, 4:].abs().max() == 0 and B[48:, :4].abs().max() == 0
    assert B[:32, :4].abs().min() > 0 and B[48:, 4:].abs().min() > 0
    gate_up = adapted.base_model.model.blocks[1].mlp.gate_up.lora_B["default"].weight
    assert gate_up[:48].abs().max() == 0 and gate_up[48:].abs().min() > 0
    assert adapted.base_model.model.blocks[1].mlp.down.lora_A["default"].weight.shape[0] == 3
    assert sorted(adapted.peft_config["default"].target_modules) == ["down", "gate_up", "lm_head", "qkv"]


def test_hf_adapter_on_a_loaded_checkpoint(tmp_path):
    """The user's path: fm.from_pretrained of HF's saved model, generate with it, then merge its adapter folder
    (an older one, with adapter_model.bin): generate sees the merged weights (no stale copy of the base's)."""
    theirs = hf_adapter("qwen2_bias_rslora", tmp_path / "adapter", seed=3, safe_serialization=False)
    assert (tmp_path / "adapter" / "adapter_model.bin").is_file()
    hf_model("qwen2_bias_rslora", seed=3).save_pretrained(tmp_path / "base")
    ids = torch.randint(1, VOCAB, (3, 7))  # no pad token (0): HF's generate would mask it
    kw = dict(max_new_tokens=4, do_sample=False)
    ours = fm.from_pretrained(tmp_path / "base")
    ours.generate(ids, **kw)
    assert load_hf_adapter(ours, tmp_path / "adapter", merge=True) is ours
    assert max_rel_err(logits(ours, ids), logits(theirs, ids)) < TOL
    assert torch.equal(ours.generate(ids, **kw, eos_token_id=[]),
                       theirs.generate(input_ids=ids, **kw, eos_token_id=None, pad_token_id=0))


def test_merging_needs_no_peft(tmp_path, monkeypatch):
    theirs = hf_adapter("llama_gqa", tmp_path / "adapter")
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails from here on
    merged = load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "adapter", merge=True)
    ids = torch.randint(0, VOCAB, (2, 5))
    assert max_rel_err(logits(merged, ids), logits(theirs, ids)) < TOL
    with pytest.raises(ImportError):
        load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "adapter")


OUR_TARGETS = {  # PEFT on our names, with ranks and alphas per module
    "llama_gqa": dict(r=3, lora_alpha=7, target_modules=["qkv", "gate_up", "down", "out_proj", "lm_head"],
                      rank_pattern={"qkv": 5}, alpha_pattern={"blocks.1.mlp.down": 2}),
    "qwen2_bias_rslora": dict(r=4, lora_alpha=4, use_rslora=True, target_modules=["qkv", "gate_up"]),
    "gpt2_conv1d": dict(r=2, lora_alpha=4, target_modules=["qkv", "fc1", "fc2", "out_proj"], rank_pattern={"fc2": 3}),
    "neox_interleaved": dict(r=4, lora_alpha=8, target_modules=["qkv", "fc2"]),
    "bert_seq_cls": dict(r=2, lora_alpha=4, task_type="SEQ_CLS", target_modules=["qkv", "fc1"]),  # + the classifier
}


@pytest.mark.parametrize("family", sorted(OUR_TARGETS))
def test_our_adapter_saved_in_hf_layout_loads_in_peft(family, tmp_path):
    ours = peft.get_peft_model(ours_from_hf(hf_model(family)), peft.LoraConfig(**OUR_TARGETS[family]))
    random_lora_(ours)
    ids = torch.randint(0, VOCAB, (2, 9))
    expected = logits(ours, ids)
    save_hf_adapter(ours, tmp_path / "adapter", base_model_name_or_path="org/base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/base" and config["peft_type"] == "LORA"
    assert not {"qkv", "gate_up", "fc1", "fc2"} & set(config["target_modules"])
    theirs = peft.PeftModel.from_pretrained(hf_model(family), tmp_path / "adapter").eval()
    assert max_rel_err(logits(theirs, ids), expected) < TOL
    assert max_rel_err(logits(theirs, ids), logits(hf_model(family), ids)) > 1e-2


def test_hf_adapter_round_trips_through_our_model(tmp_path):
    """HF's adapter, loaded onto ours and saved in HF's layout again, computes the same on HF's model."""
    theirs = hf_adapter("llama_gqa", tmp_path / "adapter")
    save_hf_adapter(load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "adapter"), tmp_path / "back")
    again = peft.PeftModel.from_pretrained(hf_model("llama_gqa"), tmp_path / "back").eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    assert max_rel_err(logits(again, ids), logits(theirs, ids)) < TOL


def test_loaded_adapter_trains_only_its_lora_weights(tmp_path):
    hf_adapter("llama_gqa", tmp_path / "adapter")
    adapted = load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "adapter", is_trainable=True)
    adapted.train()
    before = {n: p.detach().clone() for n, p in adapted.named_parameters()}
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.randint(0, VOCAB, (2, 10))
    optimizer = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=0.1)
    adapted(input_ids=ids, labels=ids).loss.backward()
    assert all(adapted.get_parameter(n).grad.abs().max() > 0 for n in trainable)
    optimizer.step()
    changed = {n for n, p in adapted.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable


def test_second_adapter_added_to_a_peft_model(tmp_path):
    """Into a PeftModel whose layers PEFT has wrapped already (LoRA layers, the classifier's modules_to_save)."""
    first = hf_adapter("bert_seq_cls", tmp_path / "a", seed=0)
    other = hf_adapter("bert_seq_cls", tmp_path / "b", seed=0, target_modules=["query"], rank_pattern={})
    adapted = load_hf_adapter(ours_from_hf(hf_model("bert_seq_cls")), tmp_path / "a")
    assert load_hf_adapter(adapted, tmp_path / "b", adapter_name="b") is adapted
    ids = torch.randint(0, VOCAB, (2, 6))
    assert max_rel_err(logits(adapted, ids), logits(first, ids)) < TOL
    adapted.set_adapter("b")
    assert max_rel_err(logits(adapted, ids), logits(other, ids)) < TOL
    assert max_rel_err(logits(other, ids), logits(first, ids)) > 1e-2
    with pytest.raises(ValueError, match="already has an adapter named 'b'"):
        load_hf_adapter(adapted, tmp_path / "b", adapter_name="b")
    with pytest.raises(ValueError, match="merge=True .* not of a PeftModel"):
        load_hf_adapter(adapted, tmp_path / "b", merge=True)


def test_save_keeps_other_files_and_replaces_the_adapter(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "README.md").write_text("mine")
    (target / "adapter_model.bin").write_bytes(b"stale weights of an older save")
    ours = peft.get_peft_model(ours_from_hf(hf_model("llama_gqa")), peft.LoraConfig(**OUR_TARGETS["llama_gqa"]))
    save_hf_adapter(ours, target)
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert (target / "README.md").read_text() == "mine"


@pytest.mark.parametrize("name", one_preset_per_family())
def test_every_family_carries_all_linear_adapters_both_ways(name, tmp_path):
    """Registry-driven: for each family's first preset at its test size, a LoRA on every linear layer of HF's
    model loads onto ours (merged and not), and one on every linear layer of ours loads onto HF's."""
    auto_class = get_family(get_preset(name).model_type).hf_auto_class
    hf = lambda: random_hf_model(tiny_hf_config(name), seed=1, auto_class=auto_class, attn_implementation="eager")  # noqa: E731
    inputs, (field, *_) = inputs_for(auto_class, tiny_hf_config(name), seed=2)

    def out(model):
        with torch.no_grad():
            return real_tokens(getattr(model(**inputs), field), inputs)

    every_linear = dict(r=3, lora_alpha=5, target_modules="all-linear", init_lora_weights=False)  # B random too
    theirs = peft.get_peft_model(hf(), peft.LoraConfig(**every_linear)).eval()
    theirs.save_pretrained(tmp_path / "hf")
    expected = out(theirs)
    assert max_rel_err(out(hf()), expected) > 1e-2
    assert max_rel_err(out(load_hf_adapter(ours_from_hf(hf()), tmp_path / "hf", merge=True)), expected) < TOL
    assert max_rel_err(out(load_hf_adapter(ours_from_hf(hf()), tmp_path / "hf")), expected) < TOL

    ours = peft.get_peft_model(ours_from_hf(hf()), peft.LoraConfig(**every_linear)).eval()
    save_hf_adapter(ours, tmp_path / "ours")
    assert max_rel_err(out(peft.PeftModel.from_pretrained(hf(), tmp_path / "ours").eval()), out(ours)) < TOL


# ------------------------------------------------------------------------------------------------------------
# What does not map is refused by name.

def test_dora_adapter_is_refused(tmp_path):
    hf_adapter("llama_gqa", tmp_path / "dora", use_dora=True, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"DoRA \(use_dora=True\).*merge_and_unload"):
        load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "dora")


def test_non_lora_adapter_is_refused(tmp_path):
    ia3 = peft.get_peft_model(hf_model("llama_gqa"), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                                    feedforward_modules=["down_proj"]))
    ia3.save_pretrained(tmp_path / "ia3")
    with pytest.raises(ValueError, match="is a PEFT IA3 adapter .*not LoRA.*merge_and_unload"):
        load_hf_adapter(ours_from_hf(hf_model("llama_gqa")), tmp_path / "ia3")


@pytest.mark.parametrize("setting, match", [
    (dict(bias="lora_only"), "bias='lora_only' trains the base layers' own biases"),
    (dict(modules_to_save=["k_proj"], target_modules=["q_proj"]),
     "modules_to_save copies that flash-models keeps fused"),
    (dict(config=dict(tie_word_embeddings=True), modules_to_save=["lm_head"], target_modules=["q_proj"]),
     "modules_to_save copies lm_head.weight, which this model does not keep apart"),
    (dict(target_modules=["embed_tokens", "q_proj"]), "LoRA on embedding layers is not carried over"),
])
def test_settings_that_do_not_map_are_refused(setting, match, tmp_path):
    hf_adapter("qwen2_bias_rslora", tmp_path / "adapter", **setting)
    with pytest.raises(ValueError, match=match):
        load_hf_adapter(ours_from_hf(hf_model("qwen2_bias_rslora", **setting.get("config", {}))), tmp_path / "adapter")


def test_adapter_of_another_size_or_architecture_is_refused(tmp_path):
    hf_adapter("llama_gqa", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"lora_A \(4, 32\).*takes lora_A \(r, 64\).*another architecture or size"):
        load_hf_adapter(ours_from_hf(hf_model("llama_gqa", hidden_size=64)), tmp_path / "llama")
    with pytest.raises(ValueError, match=r"adapts model\.layers\.1\..*no linear layer for.*architecture or depth"):
        load_hf_adapter(ours_from_hf(hf_model("llama_gqa", num_hidden_layers=1)), tmp_path / "llama")
    with pytest.raises(ValueError, match=r"adapts .*q_proj.*which this gpt2 model has no linear layer for"):
        load_hf_adapter(ours_from_hf(hf_model("gpt2_conv1d")), tmp_path / "llama")


def test_tied_lm_head_adapter_is_refused(tmp_path):
    hf_adapter("llama_gqa", tmp_path / "head", config=dict(tie_word_embeddings=True), target_modules=["lm_head"])
    with pytest.raises(ValueError, match="lm_head.*tied to the embeddings"):
        load_hf_adapter(ours_from_hf(hf_model("llama_gqa", tie_word_embeddings=True)), tmp_path / "head")


def test_adapter_from_the_hub_cache(tmp_path):
    """A Hub repo id resolves through huggingface_hub (here offline, from a cache laid out as it lays one out)."""
    theirs = hf_adapter("gpt2_conv1d", tmp_path / "adapter")
    snapshot = tmp_path / "cache" / "models--someone--gpt2-lora" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (snapshot / name).write_bytes((tmp_path / "adapter" / name).read_bytes())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    ids = torch.randint(0, VOCAB, (2, 5))
    ours = load_hf_adapter(ours_from_hf(hf_model("gpt2_conv1d")), "someone/gpt2-lora", merge=True,
                           cache_dir=tmp_path / "cache", local_files_only=True)
    assert max_rel_err(logits(ours, ids), logits(theirs, ids)) < TOL
    with pytest.raises(ValueError, match="someone/other.*not in the local HF cache"):
        load_hf_adapter(ours, "someone/other", cache_dir=tmp_path / "cache", local_files_only=True)


def test_models_other_than_ours_are_refused(tmp_path):
    hf_adapter("llama_gqa", tmp_path / "adapter")
    with pytest.raises(ValueError, match="onto a flash-models model .* use peft.PeftModel.from_pretrained"):
        load_hf_adapter(hf_model("llama_gqa"), tmp_path / "adapter")
    theirs = peft.get_peft_model(hf_model("llama_gqa"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="wraps LlamaForCausalLM, whose adapter peft_model.save_pretrained"):
        save_hf_adapter(theirs, tmp_path / "x")


def test_missing_or_incomplete_folder_is_refused(tmp_path):
    model = ours_from_hf(hf_model("llama_gqa"))
    with pytest.raises(FileNotFoundError, match="no adapter folder there"):
        load_hf_adapter(model, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        load_hf_adapter(model, tmp_path / "empty")
    hf_adapter("llama_gqa", tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="weights are missing"):
        load_hf_adapter(model, tmp_path / "adapter")


def test_export_refuses_what_hf_cannot_take(tmp_path):
    model = ours_from_hf(hf_model("llama_gqa"))
    with pytest.raises(ValueError, match="takes a peft.PeftModel"):
        save_hf_adapter(model, tmp_path / "x")
    dora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["qkv"], use_dora=True))
    with pytest.raises(ValueError, match="DoRA"):
        save_hf_adapter(dora, tmp_path / "x")
    embed = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["tokens"]))
    with pytest.raises(ValueError, match="LoRA on embedding layers is not carried over"):
        save_hf_adapter(embed, tmp_path / "x")
    with pytest.raises(ValueError, match="has no adapter 'other'"):
        save_hf_adapter(embed, tmp_path / "x", adapter_name="other")
    assert not (tmp_path / "x").exists()
