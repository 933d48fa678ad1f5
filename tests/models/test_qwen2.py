import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf, assert_kv_cache_decode_equals_full_forward,
    assert_meta_keys_match_hf,
    assert_padded_rows_equal_alone, assert_saved_model_read_by_transformers,
    assert_round_trip_bit_identical, max_rel_err, ours_from_hf, random_hf_model, random_input_ids,
)

VOCAB = 199


def qwen2_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                bos_token_id=0, eos_token_id=1)
    return transformers.Qwen2Config(**{**base, **overrides})


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [False, True])
def test_fp32_logits_and_loss_match_hf(tied, attn_impl):
    hf = random_hf_model(qwen2_config(tie_word_embeddings=tied), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert ours.blocks[0].attn.qkv.bias is not None and ours.blocks[0].attn.out_proj.bias is None
    ids = torch.randint(0, VOCAB, (3, 19))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(qwen2_config(), random_input_ids(VOCAB, (2, 30)), seed=2)


def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match():
    cfg = qwen2_config(tie_word_embeddings=True)
    assert_round_trip_bit_identical(random_hf_model(cfg, seed=3))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


def test_sliding_window_fields_without_use_sliding_window_load_as_full_attention():
    """Released Qwen2 configs carry sliding_window and max_window_layers with use_sliding_window=False."""
    cfg = qwen2_config(use_sliding_window=False, sliding_window=4, max_window_layers=1)
    hf = random_hf_model(cfg, seed=5)
    ours = ours_from_hf(hf)
    assert ours.decoder_config.attention.sliding_window is None
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits, hf(ids).logits) < 1e-5


def test_layer_types_that_contradict_the_window_fields_are_refused():
    with pytest.raises(ValueError, match="layer_types"):
        fm.checkpoint.build_model(qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                                               layer_types=["full_attention", "sliding_attention", "full_attention"]))


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_sliding_window_from_max_window_layers_on_matches_hf(attn_impl, tmp_path):
    """use_sliding_window with max_window_layers=1 of 3: layer 0 attends to every earlier key, layers 1 and 2
    through the window (4, shorter than the sequences). Logits, loss, KV-cache decoding and a left-padded greedy
    generation as HF's; transformers reads what save_pretrained writes."""
    hf = random_hf_model(qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=1), seed=10,
                         attn_implementation=attn_impl)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    assert ours.decoder_config.full_attention_layers == (0,) and ours.decoder_config.attention.sliding_window == 4
    ids = torch.randint(0, VOCAB, (2, 17))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    assert_kv_cache_decode_equals_full_forward(ours, ids, prefill=7, cache_len=24, tol=1e-5)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 9), left_pad=(1, 3), max_new_tokens=10)
    assert_saved_model_read_by_transformers(hf, tmp_path, {"input_ids": ids})


def test_sliding_window_on_every_layer_matches_hf(tmp_path):
    """max_window_layers=0 windows every layer, as Mistral does: logits, loss and a left-padded greedy
    generation as HF's, with the window (5) shorter than the sequences; the fields survive save_pretrained."""
    hf = random_hf_model(qwen2_config(use_sliding_window=True, sliding_window=5, max_window_layers=0), seed=8)
    ours = ours_from_hf(hf)
    assert ours.decoder_config.attention.sliding_window == 5
    ids = torch.randint(0, VOCAB, (2, 17))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 9), left_pad=(1, 3), max_new_tokens=10)
    ours.save_pretrained(tmp_path)
    assert fm.from_pretrained(tmp_path).config == ours.config


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    assert_padded_rows_equal_alone(ours_from_hf(random_hf_model(qwen2_config(), seed=6)), VOCAB, side=side)


def test_head_dim_in_config_json_is_honoured_as_by_transformers(tmp_path):
    """HF's Qwen2Config has no head_dim field, but its attention takes the one a config.json carries (24 here,
    not 64 / 4): so do we, and save_pretrained writes it for transformers to read back."""
    hf = random_hf_model(qwen2_config(head_dim=24), seed=9)
    ours = ours_from_hf(hf)
    assert ours.decoder_config.attention.head_dim == 24
    ids = torch.randint(0, VOCAB, (2, 15))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    assert_saved_model_read_by_transformers(hf, tmp_path, {"input_ids": ids})
