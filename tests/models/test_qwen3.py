import pytest
import torch
import transformers

from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_kv_cache_decode_equals_full_forward, assert_padded_rows_equal_alone, max_rel_err, ours_from_hf,
    random_hf_model, random_input_ids,
)

VOCAB = 173


def qwen3_config(**overrides):
    # head_dim 24 != hidden / heads = 16: Qwen3 sizes its heads on their own
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=0, eos_token_id=1)
    return transformers.Qwen3Config(**{**base, **overrides})


CONFIGS = {
    "gqa_untied": dict(),
    "mqa_tied_bias": dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True),
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_and_loss_match_hf(name, attn_impl):
    hf = random_hf_model(qwen3_config(**CONFIGS[name]), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    attn = ours.blocks[0].attn
    assert attn.q_norm is not None and (attn.out_proj.bias is not None) == ("bias" in name)
    ids = torch.randint(0, VOCAB, (3, 21))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_the_qk_norms_act():
    """Their weights come from the checkpoint and change the output: a model without them would differ."""
    ours = ours_from_hf(random_hf_model(qwen3_config(), seed=2))
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        before = ours(ids).logits
        ours.blocks[1].attn.k_norm.weight.mul_(1.5)
        assert max_rel_err(ours(ids).logits, before) > 1e-3


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(qwen3_config(), random_input_ids(VOCAB, (2, 30)), seed=3)


def test_kv_cache_decode_equals_full_forward():
    ours = ours_from_hf(random_hf_model(qwen3_config(), seed=4))
    ids = torch.randint(0, VOCAB, (2, 17))
    assert_kv_cache_decode_equals_full_forward(ours, ids, prefill=9, cache_len=32, tol=1e-5)


def test_greedy_generation_equals_hf_on_left_padded_batch():
    hf = random_hf_model(qwen3_config(), seed=5)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 8), left_pad=(1, 3), max_new_tokens=20)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    assert_padded_rows_equal_alone(ours_from_hf(random_hf_model(qwen3_config(), seed=6)), VOCAB, side=side)


def test_sliding_window_from_max_window_layers_on_matches_hf():
    """Layers 0 and 1 of 3 attend to every earlier key, layer 2 through the window (5): as HF's Qwen3."""
    hf = random_hf_model(qwen3_config(use_sliding_window=True, sliding_window=5, max_window_layers=2), seed=7)
    ours = ours_from_hf(hf)
    assert ours.decoder_config.full_attention_layers == (0, 1)
    ids = torch.randint(0, VOCAB, (2, 16))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 8), left_pad=(0, 2), max_new_tokens=10)


def test_our_kernels_on_a_padded_batch_stay_within_hf_bf16_error():
    """attn_impl='flash' and kernel_backend='triton' (on a CPU through Triton's interpreter): the q/k norms run
    as our RMSNorm kernel over each head, before rotary and varlen attention over the unpadded rows."""
    ids = torch.randint(0, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: HF's positions count from 0 as ours do
    assert_bf16_error_bounded(qwen3_config(num_hidden_layers=2), {"input_ids": ids, "attention_mask": mask}, seed=7,
                              attn_impl="flash", kernel_backend="triton")
