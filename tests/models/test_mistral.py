import pytest
import torch
import transformers

from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_kv_cache_decode_equals_full_forward, assert_meta_keys_match_hf, assert_padded_rows_equal_alone,
    assert_round_trip_bit_identical, max_rel_err, ours_from_hf, random_hf_model, random_input_ids,
)

VOCAB = 211
WINDOW = 5  # far shorter than the sequences below, so every test crosses the window


def mistral_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, sliding_window=WINDOW, bos_token_id=0, eos_token_id=1)
    return transformers.MistralConfig(**{**base, **overrides})


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_fp32_logits_and_loss_match_hf_across_the_window(attn_impl):
    hf = random_hf_model(mistral_config(), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, VOCAB, (2, 26))
    out = assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    with torch.no_grad():
        no_window = ours_from_hf(random_hf_model(mistral_config(sliding_window=None), seed=1))(ids).logits
    assert max_rel_err(no_window[:, WINDOW:], out.logits[:, WINDOW:]) > 1e-3, "the window must change the output"


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(mistral_config(), random_input_ids(VOCAB, (2, 30)), seed=2)


def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match():
    cfg = mistral_config(num_key_value_heads=1, tie_word_embeddings=True)
    assert_round_trip_bit_identical(random_hf_model(cfg, seed=3))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    assert_padded_rows_equal_alone(ours_from_hf(random_hf_model(mistral_config(), seed=5)), VOCAB, side=side)


def test_kv_cache_decode_keeps_the_window():
    ours = ours_from_hf(random_hf_model(mistral_config(), seed=6))
    ids = torch.randint(0, VOCAB, (2, 21))
    assert_kv_cache_decode_equals_full_forward(ours, ids, prefill=4, cache_len=32, tol=1e-5)


def test_greedy_generation_past_the_window_equals_hf():
    hf = random_hf_model(mistral_config(), seed=7)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 7), left_pad=(1, 2), max_new_tokens=24)
