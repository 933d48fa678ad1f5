import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import (
    assert_bf16_error_bounded, assert_fp32_parity, assert_meta_keys_match_hf, assert_padded_rows_equal_alone,
    assert_round_trip_bit_identical, ours_from_hf, random_hf_model, random_input_ids,
)

VOCAB = 181


def gptj_config(**overrides):
    base = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=3, n_head=4, rotary_dim=8, bos_token_id=0,
                eos_token_id=1)
    return transformers.GPTJConfig(**{**base, **overrides})


def hf_gptj(cfg, seed):
    return random_hf_model(cfg, seed=seed, attn_implementation="eager")  # HF's GPT-J has no SDPA path


CONFIGS = {
    "partial_rotary": dict(),
    "full_rotary_relu_inner": dict(rotary_dim=16, activation_function="relu", n_inner=80, layer_norm_epsilon=1e-3),
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_and_loss_match_hf(name, attn_impl):
    hf = hf_gptj(gptj_config(**CONFIGS[name]), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, VOCAB, (3, 21))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


def test_bf16_error_bounded_by_hf_own_bf16_error():
    # eager, as hf_gptj builds it
    assert_bf16_error_bounded(gptj_config(), random_input_ids(VOCAB, (2, 29)), seed=2, attn_implementation="eager")


@pytest.mark.parametrize("name", CONFIGS)
def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match(name):
    cfg = gptj_config(**CONFIGS[name])
    assert_round_trip_bit_identical(hf_gptj(cfg, seed=3))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


def test_tied_gptj_is_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        fm.checkpoint.build_model(gptj_config(tie_word_embeddings=True))


@pytest.mark.parametrize("rotary_dim, match", [(32, "rotary_dim 32 exceeds the head dim 16"), (5, "must be even")])
def test_rotary_dim_transformers_cannot_run_is_refused_at_load(rotary_dim, match):
    """HF's GPT-J fails on these in its first forward with a shape mismatch; we refuse them when building."""
    with pytest.raises(ValueError, match=match):
        fm.checkpoint.build_model(gptj_config(rotary_dim=rotary_dim))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    ours = ours_from_hf(hf_gptj(gptj_config(), seed=5))
    assert_padded_rows_equal_alone(ours, VOCAB, side=side)
