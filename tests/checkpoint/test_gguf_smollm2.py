"""The embedded real checkpoint: SmolLM2-135M-Instruct, GGUF Q4_1, against transformers' own GGUF load."""

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.checkpoint.gguf_file import permute_rotary, unpermute_rotary

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path():
    return fm.smollm2_gguf()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def ours(gguf_path):
    return fm.from_pretrained(gguf_path)


def test_config_read_from_metadata(ours):
    cfg = ours.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and ours.head_is_tied()


def test_rotary_permutation_round_trip():
    w = torch.randn(3 * 64, 40)
    assert torch.equal(unpermute_rotary(permute_rotary(w, 3), 3), w)
    assert not torch.equal(permute_rotary(w, 3), w)


def test_logits_match_transformers_gguf_load(ours, hf_model, tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog because", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (ours(ids).logits - hf_model(ids).logits).abs().max().item()
    assert diff < 1e-3


def test_greedy_generation_equals_hf_for_32_tokens(ours, hf_model, tokenizer):
    ids = tokenizer("Once upon a time, in a small village,", return_tensors="pt").input_ids
    ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = ours.generate(ids, max_new_tokens=32, eos_token_id=[])
    assert torch.equal(out, ref)
    with torch.inference_mode():  # what generate decoded with: the lean CPU step (runtime/cpu_decode.py)
        assert ours.lean_decode_step(ours.new_kv_cache(1, 8)) is not None


def test_chat_answer_names_paris(ours, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = ours.generate(ids, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
