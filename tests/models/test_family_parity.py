"""Parity with transformers for every registered preset, at its family's test size (``Family.tiny``): our
model holding a random HF model's weights gives HF's outputs in fp32, the checkpoint rules round-trip HF's
state dict bit for bit, and transformers reads what ``save_pretrained`` writes. A new family gets these by
existing; its own test file adds what is particular to it (other configs, padding, generation, bf16)."""

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.checkpoint import build_model
from flash_models.checkpoint.remap import hf_to_ours
from flash_models.registry import get_family, get_preset, rules_for
from flash_models.testing import (
    assert_round_trip_bit_identical, assert_saved_model_read_by_transformers, max_rel_err, ours_from_hf,
    random_hf_model,
)


def tiny_hf_config(name, **overrides):
    preset = get_preset(name)
    fields = {**preset.hf_config, **get_family(preset.model_type).tiny(preset.hf_config), **overrides}
    return transformers.AutoConfig.for_model(preset.model_type, **fields)


def inputs_for(auto_class, hf_config, seed):
    """Forward keyword arguments for a model read by ``auto_class``, and the outputs to compare."""
    gen = torch.Generator().manual_seed(seed)
    if auto_class == "AutoModelForImageClassification":
        size = (3, hf_config.num_channels, hf_config.image_size, hf_config.image_size)
        return {"pixel_values": torch.randn(size, generator=gen)}, ("logits",)
    ids = torch.randint(0, hf_config.vocab_size, (3, 17), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    if auto_class == "AutoModel":  # an encoder
        types = torch.randint(0, hf_config.type_vocab_size, ids.shape, generator=gen)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}, ("last_hidden_state", "pooler_output")
    assert auto_class == "AutoModelForCausalLM", f"add inputs for {auto_class}"
    return {"input_ids": ids}, ("logits",)


def real_tokens(tensor, inputs):
    mask = inputs.get("attention_mask")
    return tensor[mask.bool()] if mask is not None and tensor.dim() == 3 else tensor


def assert_fp32_outputs_match_hf(name, **overrides):
    """The preset ``name`` at its family's test size, with ``overrides`` of HF config fields."""
    auto_class = get_family(get_preset(name).model_type).hf_auto_class
    hf_config = tiny_hf_config(name, **overrides)
    hf = random_hf_model(hf_config, seed=1, auto_class=auto_class, attn_implementation="eager")
    ours = ours_from_hf(hf)
    inputs, outputs = inputs_for(auto_class, hf_config, seed=1)
    with torch.no_grad():
        ref, out = hf(**inputs), ours(**inputs)
    for field in outputs:
        err = max_rel_err(real_tokens(getattr(out, field), inputs), real_tokens(getattr(ref, field), inputs))
        assert err < 1e-5, f"{field} differs from HF's: {err:.3g}"
    if auto_class == "AutoModelForCausalLM":
        ids = inputs["input_ids"]
        with torch.no_grad():
            assert torch.allclose(ours(ids, labels=ids).loss, hf(ids, labels=ids).loss, rtol=1e-5)


@pytest.mark.parametrize("name", fm.list_models())
def test_fp32_outputs_match_hf(name):
    assert_fp32_outputs_match_hf(name)


CAUSAL_LMS = [name for name in fm.list_models()
              if get_family(get_preset(name).model_type).hf_auto_class == "AutoModelForCausalLM"]


def hf_gradients_as_ours(hf, ours) -> dict:
    """HF's parameter gradients under our names (the checkpoint rules applied to gradients as to weights: fused
    q/k/v, transposed Conv1D ...); a tied parameter's gradient under each of its names."""
    grads = {name: param.grad if param.grad is not None else torch.zeros_like(param)
             for name, param in hf.named_parameters(remove_duplicate=False)}
    return hf_to_ours(grads, rules_for(ours.config))


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_fp32_gradients_match_hf_with_pad_tokens_and_ignored_labels(name):
    """Every parameter's gradient of the LM loss (labels with -100) equals HF's. The input holds the pad token:
    LLaMA's, Mistral's, Qwen's and OPT's embeddings take HF's padding_idx (no gradient to the pad row), GPT-2's,
    GPT-NeoX's and GPT-J's don't."""
    auto_class = get_family(get_preset(name).model_type).hf_auto_class
    hf_config = tiny_hf_config(name, pad_token_id=3)
    hf = random_hf_model(hf_config, seed=4, auto_class=auto_class, attn_implementation="eager")
    ours = ours_from_hf(hf)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, hf_config.vocab_size, (2, 13), generator=gen)
    ids[:, ::4] = 3
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, -2:] = -100
    hf(ids, labels=labels).loss.backward()
    ours(ids, labels=labels).loss.backward()
    expected = hf_gradients_as_ours(hf, ours)
    for key, param in ours.named_parameters():
        got = param.grad[tuple(slice(0, n) for n in expected[key].shape)]  # the real rows of a padded vocabulary
        assert max_rel_err(got, expected[key]) < 1e-5, key


@pytest.mark.parametrize("name", [name for name in fm.list_models() if name not in CAUSAL_LMS])
def test_fp32_gradients_match_hf_for_encoders(name):
    """Every parameter's gradient equals HF's, for the gradient of a fixed random projection of each output
    (on the real tokens of a padded batch whose ids include BERT's pad token)."""
    auto_class = get_family(get_preset(name).model_type).hf_auto_class
    hf_config = tiny_hf_config(name)
    hf = random_hf_model(hf_config, seed=5, auto_class=auto_class, attn_implementation="eager")
    ours = ours_from_hf(hf)
    inputs, outputs = inputs_for(auto_class, hf_config, seed=5)
    if "input_ids" in inputs:
        inputs["input_ids"][:, ::5] = hf_config.pad_token_id
    gen = torch.Generator().manual_seed(5)
    for model in (hf, ours):
        results = model(**inputs)
        objective = 0
        for field in outputs:
            value = real_tokens(getattr(results, field), inputs)
            objective = objective + (value * torch.randn(value.shape, generator=gen.manual_seed(6))).sum()
        objective.backward()
    expected = hf_gradients_as_ours(hf, ours)
    for key, param in ours.named_parameters():
        assert max_rel_err(param.grad, expected[key]) < 1e-5, key


# Values real checkpoints carry that the presets don't: (preset, HF config fields).
UNUSUAL_CONFIGS = {
    "gpt2_swish": ("gpt2", dict(activation_function="swish")),  # transformers' other name for SiLU
    "opt_gelu_python": ("opt-125m", dict(activation_function="gelu_python")),
    "pythia_gelu_fast": ("pythia-160m", dict(hidden_act="gelu_fast")),
    "llama_swish": ("llama-1b", dict(hidden_act="swish")),
}


@pytest.mark.parametrize("case", UNUSUAL_CONFIGS)
def test_fp32_outputs_match_hf_for_unusual_configs(case):
    name, overrides = UNUSUAL_CONFIGS[case]
    assert_fp32_outputs_match_hf(name, **overrides)


@pytest.mark.parametrize("name, overrides, match", [
    ("llama-1b", dict(hidden_act="quick_gelu"), r"'quick_gelu' \(the config's hidden_act / activation_function\)"),
    ("gpt2", dict(activation_function="tanh"), r"'tanh' \(the config's hidden_act / activation_function\)"),
    ("llama-1b", dict(hidden_act="relu"), r"'relu' \(the config's hidden_act\) in a gated MLP"),
])
def test_unsupported_activation_is_refused_naming_the_field(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        build_model(tiny_hf_config(name, **overrides))


@pytest.mark.parametrize("name", fm.list_models())
def test_rules_round_trip_and_transformers_reads_what_we_save(name, tmp_path):
    auto_class = get_family(get_preset(name).model_type).hf_auto_class
    hf_config = tiny_hf_config(name)
    hf = random_hf_model(hf_config, seed=2, auto_class=auto_class, attn_implementation="eager")
    assert_round_trip_bit_identical(hf)
    inputs, outputs = inputs_for(auto_class, hf_config, seed=2)
    assert_saved_model_read_by_transformers(hf, tmp_path, inputs, auto_class=auto_class, output=outputs[0])
