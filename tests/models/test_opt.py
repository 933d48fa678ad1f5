import pytest
import torch
import transformers

import flash_models as fm
from flash_models.testing import (
    assert_bf16_error_bounded, assert_checkpoint_file_loads, assert_fp32_parity, assert_greedy_generation_equals_hf,
    assert_left_padded_logits_match_hf, assert_meta_keys_match_hf, assert_padded_rows_equal_alone,
    assert_round_trip_bit_identical, ours_from_hf, random_hf_model, random_input_ids,
)

VOCAB = 167


def opt_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, ffn_dim=112, num_attention_heads=4,
                max_position_embeddings=48, dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return transformers.OPTConfig(**{**base, **overrides})


CONFIGS = {
    "pre_norm": dict(),  # OPT-125m and the large ones
    "post_norm_projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # OPT-350m
    "pre_norm_projected_untied_no_bias": dict(word_embed_proj_dim=48, tie_word_embeddings=False, enable_bias=False),
}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_and_loss_match_hf(name, attn_impl):
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=1)
    ours = ours_from_hf(hf, attn_impl=attn_impl)
    ids = torch.randint(0, VOCAB, (3, 22))
    assert_fp32_parity(hf, ours, ids, labels=ids, tol=1e-5)


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_left_padded_batch_matches_hf_positions_with_offset(name):
    """HF's OPT derives positions from the mask as we do (then adds its offset of 2)."""
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=2)
    ours = ours_from_hf(hf)
    ids = torch.randint(3, VOCAB, (3, 19))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :18] = 0
    assert_left_padded_logits_match_hf(hf, ours, ids, mask, tol=1e-5)


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_padded_batch_logits_and_loss_match_hf_at_every_position(name):
    """HF's OPT numbers padding -1 (row 1 of its offset table), left or right: its logits there, and so a loss
    whose labels do not mask the padding, are HF's too (HF's default SDPA attention)."""
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=5, attn_implementation="sdpa")
    ours = ours_from_hf(hf, attn_impl="sdpa")
    ids = torch.randint(3, VOCAB, (3, 13))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    with torch.no_grad():
        ref, out = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_bf16_error_bounded_by_hf_own_bf16_error(name):
    assert_bf16_error_bounded(opt_config(**CONFIGS[name]), random_input_ids(VOCAB, (2, 27)), seed=3)


@pytest.mark.parametrize("name", CONFIGS)
def test_to_hf_of_from_hf_is_bit_identical_and_meta_keys_match(name):
    cfg = opt_config(**CONFIGS[name])
    assert_round_trip_bit_identical(random_hf_model(cfg, seed=4))
    assert_meta_keys_match_hf(cfg, auto_class="AutoModelForCausalLM")


def test_opt_model_keys_without_prefix_load(tmp_path):
    """facebook/opt-* files were written from OPTModel: keys start at "decoder.", and carry a tied lm_head."""
    hf = random_hf_model(opt_config(**CONFIGS["post_norm_projected"]), seed=5)
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    assert_checkpoint_file_loads(hf, state, tmp_path, random_input_ids(VOCAB, (1, 9)), tol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_padded_batch_equals_each_sequence_alone(name, side):
    ours = ours_from_hf(random_hf_model(opt_config(**CONFIGS[name]), seed=7))
    assert_padded_rows_equal_alone(ours, VOCAB, side=side)


@pytest.mark.parametrize("name", ["pre_norm", "post_norm_projected"])
def test_greedy_generation_equals_hf_on_left_padded_batch(name):
    hf = random_hf_model(opt_config(**CONFIGS[name]), seed=8)
    ours = ours_from_hf(hf)
    assert_greedy_generation_equals_hf(hf, ours, vocab_size=VOCAB, shape=(2, 8), left_pad=(0, 2), pad_token_id=1, low=3,
                                       max_new_tokens=24)


@pytest.mark.parametrize("field, value", [("layerdrop", 0.1), ("layer_norm_elementwise_affine", False), ("_remove_final_layer_norm", True)])
def test_unsupported_options_raise(field, value):
    with pytest.raises(ValueError, match=field.lstrip("_")):
        fm.checkpoint.build_model(opt_config(**{field: value}))
