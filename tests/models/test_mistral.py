import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import (
    assert_meta_keys_match_hf, assert_padded_rows_equal_alone, assert_round_trip_bit_identical, low_precision_bound_ok,
    max_rel_err, ours_from_hf, random_hf_model,
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
    with torch.no_grad():
        ref, out = hf(ids, labels=ids), ours(ids, labels=ids)
        no_window = ours_from_hf(random_hf_model(mistral_config(sliding_window=None), seed=1))(ids).logits
    assert max_rel_err(out.logits, ref.logits) < 1e-5
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5)
    assert max_rel_err(no_window[:, WINDOW:], out.logits[:, WINDOW:]) > 1e-3, "the window must change the output"


def test_bf16_error_bounded_by_hf_own_bf16_error():
    cfg = mistral_config()
    hf32 = random_hf_model(cfg, seed=2)
    hf16 = random_hf_model(cfg, seed=2).to(torch.bfloat16)
    ours16 = ours_from_hf(hf32, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        ok, ours_err, hf_err = low_precision_bound_ok(ours16(ids).logits.float(), hf16(ids).logits.float(), hf32(ids).logits)
    assert ok, f"ours bf16 error {ours_err:.3g} vs HF's own bf16 error {hf_err:.3g}"


def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match():
    cfg = mistral_config(num_key_value_heads=1, tie_word_embeddings=True)
    assert_round_trip_bit_identical(random_hf_model(cfg, seed=3))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


def test_save_pretrained_is_read_by_transformers_with_same_logits(tmp_path):
    hf = random_hf_model(mistral_config(), seed=4)
    ours = ours_from_hf(hf)
    ours.save_pretrained(tmp_path)
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        assert max_rel_err(reread(ids).logits, hf(ids).logits) < 1e-6
    again = fm.from_pretrained(tmp_path)
    assert again.config == ours.config and again.config.sliding_window == WINDOW


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    assert_padded_rows_equal_alone(ours_from_hf(random_hf_model(mistral_config(), seed=5)), VOCAB, side=side)


def test_kv_cache_decode_keeps_the_window():
    ours = ours_from_hf(random_hf_model(mistral_config(), seed=6))
    ids = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        full = ours(ids).logits
        cache = ours.new_kv_cache(2, 32)
        steps = [ours(ids[:, :4], kv_cache=cache).logits]
        steps += [ours(ids[:, t:t + 1], kv_cache=cache).logits for t in range(4, 21)]
    assert max_rel_err(torch.cat(steps, dim=1), full) < 1e-5


def test_greedy_generation_past_the_window_equals_hf():
    hf = random_hf_model(mistral_config(), seed=7)
    ours = ours_from_hf(hf)
    ids = torch.randint(2, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out, ref)
