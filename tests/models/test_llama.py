import pytest
import torch
import transformers

from flash_models.checkpoint import build_model
from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_kv_cache_decode_equals_full_forward, assert_left_padded_logits_match_hf, assert_saved_model_read_by_transformers,
    max_rel_err, ours_from_hf, random_hf_model, random_input_ids,
)


def llama_config(**overrides):
    base = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                pad_token_id=None)
    return transformers.LlamaConfig(**{**base, **overrides})


ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    # one divisor per frequency (head dim 16: 8 of them), the long ones past 16 positions; no factor given: HF's
    # is max_position_embeddings / 16
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                 "long_factor": [5.0, 7.5, 12.0, 19.5, 30.5, 47.5, 70.0, 105.0]},
}

CONFIGS = {
    "gqa_untied": dict(),
    "mqa_tied_bias": dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mha_head_dim": dict(num_key_value_heads=4, head_dim=24),
}


@pytest.mark.parametrize("rope", ROPE)
def test_fp32_logits_match_hf_for_each_rope_scaling(rope):
    hf = random_hf_model(llama_config(rope_parameters=ROPE[rope]), seed=1)
    ours = ours_from_hf(hf)
    assert_fp32_parity(hf, ours, torch.randint(0, 257, (2, 40)), tol=1e-5)


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_rope_whose_frequencies_change_past_a_length_matches_hf_in_forward_and_generation(rope, tmp_path):
    """LongRoPE switches to its long factors, dynamic NTK rescales its base, once a sequence passes a length
    (16 here): a short forward keeps the short frequencies, and a greedy generation that crosses the length
    (prompts of 10, 12 new tokens) gives HF's tokens, keys cached before the switch keeping their rotation.
    transformers reads the rope parameters save_pretrained writes."""
    hf = random_hf_model(llama_config(rope_parameters=ROPE[rope], max_position_embeddings=16 if rope == "dynamic" else 64),
                         seed=12)
    ours = ours_from_hf(hf)
    assert_fp32_parity(hf, ours, torch.randint(0, 257, (2, 11)), tol=1e-5)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=257, shape=(2, 10), left_pad=(1, 3), max_new_tokens=12)
    assert_saved_model_read_by_transformers(hf, tmp_path, random_input_ids(257, (2, 30)))


def test_generation_past_the_position_limit_after_a_shorter_forward_matches_hf():
    """Rotary tables grow past max_position_embeddings (16) as positions need them, also once a shorter forward
    has made a table of 16: prompts of 7 tokens, 14 new ones, positions up to 19, as HF's."""
    hf = random_hf_model(llama_config(max_position_embeddings=16, rope_parameters=ROPE["linear"]), seed=13)
    ours = ours_from_hf(hf)
    with torch.no_grad():
        ours(torch.randint(0, 257, (1, 7)))
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=257, shape=(2, 7), max_new_tokens=14)


def test_dynamic_rope_past_the_position_limit_matches_hf():
    hf = random_hf_model(llama_config(rope_parameters=ROPE["dynamic"], max_position_embeddings=16), seed=7)
    ours = ours_from_hf(hf)
    assert_fp32_parity(hf, ours, torch.randint(0, 257, (1, 40)), tol=1e-5)  # 40 > 16: the NTK base is rescaled


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_and_loss_match_hf(name, attn_impl):
    hf = random_hf_model(llama_config(**CONFIGS[name]), seed=2)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, 257, (3, 23))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_left_padded_batch_matches_hf():
    hf = random_hf_model(llama_config(), seed=3)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 257, (3, 21))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    mask[2, :20] = 0  # a single real token
    assert_left_padded_logits_match_hf(hf, ours, ids, mask, tol=1e-5)


def test_right_padding_leaves_real_tokens_unchanged():
    ours = ours_from_hf(random_hf_model(llama_config(), seed=4))
    ids = torch.randint(0, 257, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask).logits
        alone = ours(ids[1:, :8]).logits
    assert max_rel_err(padded[1, :8], alone[0]) < 1e-5


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(llama_config(), random_input_ids(257, (2, 33)), seed=5)


def test_kv_cache_decode_equals_full_forward():
    ours = ours_from_hf(random_hf_model(llama_config(), seed=6))
    ids = torch.randint(0, 257, (2, 19))
    assert_kv_cache_decode_equals_full_forward(ours, ids, prefill=11, cache_len=32, tol=1e-5)


def test_greedy_generation_equals_hf_on_left_padded_batch():
    hf = random_hf_model(llama_config(), seed=8)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=257, shape=(2, 10), left_pad=(1, 4), max_new_tokens=32)


def test_generation_stops_rows_at_eos_and_pads_them():
    ours = ours_from_hf(random_hf_model(llama_config(), seed=9))
    ids = torch.randint(2, 257, (2, 6))
    plain = ours.generate(ids, max_new_tokens=12, eos_token_id=[])
    eos = int(plain[0, 8])  # row 0's third new token becomes "EOS"
    out = ours.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    first = (out[0, 6:] == eos).nonzero()[0, 0].item()
    assert (out[0, 6 + first + 1:] == 0).all()
    assert torch.equal(out[0, :6 + first + 1], plain[0, :6 + first + 1])


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_packed_documents_equal_separate_sequences_and_never_mix(attn_impl):
    ours = ours_from_hf(random_hf_model(llama_config(), seed=10), attn_impl=attn_impl)
    docs = [torch.randint(0, 257, (n,)) for n in (7, 1, 12)]
    packed = torch.cat(docs).unsqueeze(0)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    captured = {}

    def keep_embeddings(module, args, output):
        output.retain_grad()
        captured["hidden"] = output

    handle = ours.embed.register_forward_hook(keep_embeddings)
    logits = ours(packed, cu_seqlens=cu).logits[0]
    handle.remove()
    with torch.no_grad():
        for doc, start in zip(docs, (0, 7, 8)):
            alone = ours(doc.unsqueeze(0)).logits[0]
            assert max_rel_err(logits[start:start + len(doc)], alone) < 1e-5
    # Token 10 sits in the third document (tokens 8..19): only tokens 8..10 may influence it.
    logits[10].sum().backward()
    grad = captured["hidden"].grad[0].abs().sum(-1)  # (total,)
    assert (grad[:8] == 0).all() and (grad[11:] == 0).all()
    assert (grad[8:11] > 0).all()


def test_negative_pad_token_id_counts_from_the_vocabulary_end_and_one_outside_is_refused():
    """As torch's padding_idx, -1 is the last real token (HF builds nn.Embedding(257, ..., padding_idx=-1)), not
    the last row of our padded table; an id outside the vocabulary fails in HF too, here with a ValueError."""
    hf = random_hf_model(llama_config(pad_token_id=-1), seed=11)
    ours = ours_from_hf(hf)
    assert ours.embed.tokens.num_embeddings > 257 and ours.embed.tokens.padding_idx == 256
    ids = torch.randint(0, 257, (2, 9))
    ids[:, 2] = 256
    hf(ids, labels=ids).loss.backward()
    ours(ids, labels=ids).loss.backward()
    assert (ours.embed.tokens.weight.grad[256] == 0).all()
    assert max_rel_err(ours.embed.tokens.weight.grad[:257], hf.model.embed_tokens.weight.grad) < 1e-5
    with pytest.raises(ValueError, match="pad_token_id 257 is outside the vocabulary of 257 tokens"):
        build_model(llama_config(pad_token_id=257))


def test_resized_token_table_keeps_the_pad_row_without_gradient():
    """HF's resize_token_embeddings keeps the embedding's padding_idx; so do we, and the grown table's pad row
    still gets no gradient. A size that would leave the pad token out is refused before anything changes."""
    ours = ours_from_hf(random_hf_model(llama_config(pad_token_id=5), seed=14))
    ours.resize_token_embeddings(300)
    assert ours.embed.tokens.padding_idx == 5
    ids = torch.randint(0, 300, (2, 9))
    ids[:, 3], ids[:, 4] = 5, 299  # the pad token and a new one
    ours(ids, labels=ids).loss.backward()
    assert (ours.embed.tokens.weight.grad[5] == 0).all() and ours.embed.tokens.weight.grad[299].abs().sum() > 0
    with pytest.raises(ValueError, match="pad_token_id 5 is outside the vocabulary of 4 tokens"):
        ours.resize_token_embeddings(4)
    assert ours.config.vocab_size == 300 and ours.decoder_config.vocab_size == 300
