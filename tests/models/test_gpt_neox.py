import pytest
import torch
import transformers

from flash_models.testing import (
    assert_bf16_error_bounded, assert_checkpoint_file_loads, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_meta_keys_match_hf, assert_padded_rows_equal_alone, assert_round_trip_bit_identical,
    assert_saved_model_read_by_transformers, low_precision_bound_ok, ours_from_hf, random_hf_model,
    random_input_ids,
)

VOCAB = 193


def neox_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=112,
                max_position_embeddings=64, rotary_pct=0.25, bos_token_id=0, eos_token_id=1)
    return transformers.GPTNeoXConfig(**{**base, **overrides})


CONFIGS = {
    "parallel_half_rotary": dict(rotary_pct=0.5, rotary_emb_base=500.0),
    "sequential_no_bias": dict(use_parallel_residual=False, attention_bias=False, hidden_act="gelu_new"),
    "parallel_tied_full_rotary": dict(rotary_pct=1.0, tie_word_embeddings=True, layer_norm_eps=1e-3),
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_and_loss_match_hf(name, attn_impl):
    hf = random_hf_model(neox_config(**CONFIGS[name]), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, VOCAB, (3, 23))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_bf16_error_bounded_by_hf_own_bf16_error():
    assert_bf16_error_bounded(neox_config(**CONFIGS["parallel_half_rotary"]), random_input_ids(VOCAB, (2, 31)), seed=2)


@pytest.mark.parametrize("name", CONFIGS)
def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match(name):
    cfg = neox_config(**CONFIGS[name])
    assert_round_trip_bit_identical(random_hf_model(cfg, seed=3))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


def test_checkpoint_with_transformers4_head_name_loads(tmp_path):
    hf = random_hf_model(neox_config(), seed=4)
    state = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in hf.state_dict().items()}
    assert_checkpoint_file_loads(hf, state, tmp_path, random_input_ids(VOCAB, (1, 9)), tol=1e-5)


@pytest.mark.parametrize("name", ["parallel_half_rotary", "sequential_no_bias"])
def test_save_pretrained_is_read_by_transformers_with_same_logits(name, tmp_path):
    hf = random_hf_model(neox_config(**CONFIGS[name]), seed=5)
    assert_saved_model_read_by_transformers(hf, tmp_path, random_input_ids(VOCAB, (2, 12)), tol=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    ours = ours_from_hf(random_hf_model(neox_config(**CONFIGS["parallel_half_rotary"]), seed=6))
    assert_padded_rows_equal_alone(ours, VOCAB, side=side)


def test_greedy_generation_equals_hf_on_left_padded_batch():
    hf = random_hf_model(neox_config(**CONFIGS["parallel_half_rotary"]), seed=7)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 9), left_pad=(1, 3), max_new_tokens=24)


def test_our_kernels_on_a_padded_batch_stay_within_hf_bf16_error():
    """attn_impl='flash' and kernel_backend='triton' (on a CPU through Triton's interpreter): the fused dual
    LayerNorm of the parallel block, partial rotary and varlen attention over the unpadded rows."""
    cfg = neox_config(num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.5)  # head dim 32 for the kernels
    hf32 = random_hf_model(cfg, seed=8)
    hf16 = random_hf_model(cfg, seed=8).to(torch.bfloat16)
    ours = ours_from_hf(hf32, attn_impl="flash", kernel_backend="triton", dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 19))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        out = ours(ids, attention_mask=mask, mask_positions=True).logits[real].float()
        theirs = hf16(ids, attention_mask=mask, position_ids=positions).logits[real].float()
        ref = hf32(ids, attention_mask=mask, position_ids=positions).logits[real]
    ok, ours_err, hf_err = low_precision_bound_ok(out, theirs, ref)
    assert ok, f"ours bf16 error {ours_err:.3g} vs HF's own bf16 error {hf_err:.3g}"
